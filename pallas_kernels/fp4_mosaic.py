"""NVFP4 weight matmul for Hopper in Mosaic GPU, with the weights packed as wgmma register fragments.

`fp4_matmul_mosaic(x, w)` computes what `fp4_matmul.fp4_matmul` does, x[M, K] (bf16) @
dequantize(w)^T for M <= 64 (decode), on an sm_90 GPU, from a `FragmentWeight`: the weight's codes
and scales permuted once, at weight sync (`pack_fragments`), into the order the kernel's registers
want them (Marlin's idea, for the wgmma A operand). The layout:

  * Weights sit on the MMA's M side and tokens on its N side (out^T = W x^T): a warpgroup owns 64
    weight rows; x is read in [16..64, K] tiles whose rows past M the copy engine fills with
    zeros. (x's copies are tiled 8 rows deep, so a tile starts at a multiple of 8 rows, and an x of
    more than 8 rows that are not a multiple of 8 is padded first: one more launch.)
  * For every 16-wide K chunk, a thread's share of the m64 x k16 A fragment is 8 weights (rows r
    and r + 8, columns 2c, 2c + 1, 2c + 8, 2c + 9): exactly one 32-bit word of codes. A thread's
    words for 4 consecutive chunks are contiguous (one 16-byte shared-memory load), and the 128
    threads' words follow one another (conflict-free).
  * Inside a word the 32 code bits are spread so that four masks, three shifts and four byte
    permutes give the fragment's four bf16x2 registers (`decode_word`): E2M1's exponent and
    mantissa bits land on bf16 bits 8-6 (the value times 2^-126, E2M1's subnormal 0.5 included)
    and the sign on bit 15. (11 instructions per 8 weights; a search over all such layouts finds
    none cheaper: every cleaned byte needs its own bit alignment.)
  * Scales: NVFP4 blocks (16) are the K chunks, so a thread needs two scales per chunk (rows r and
    r + 8), shared by the 4 threads of a quad, stored once per quad. They are re-encoded at
    packing time from E4M3 to an 8-bit "UE5M3" byte u whose bfloat16 value is 0x7000 | u << 4
    (the scale times 2^119: normal for every E4M3 value, E4M3 subnormals included; NaN stays
    NaN), laid out so that 3 instructions give 4 scales (`decode_scales`). One bf16x2 multiply per
    register applies them, the scale broadcast by the multiply's operand selector (exact: the
    product has at most 6 significant bits); the f32 result times 2^7 and the NVFP4 tensor scale
    is the matmul, written by the kernel itself (one launch per call).
  * A zero scale (a block of zeros) has no UE5M3 byte: its codes are zeroed instead (same values).
    A negative scale flips its block's code signs (same values).
  * Codes and scales travel as one int32 stream (`FragmentWeight.words`): one copy per pipeline
    step, issued by a producer warpgroup, so that the consumer's loop only decodes and multiplies.
    Not marked evict-first: Mosaic GPU's TMA copies pass no L2 cache hint (jax 0.10.2, and jax's
    source at 0.11.1; 0.11.2, the GPU image's, unchecked).
  * x's tiles can be shared by a cluster of blocks (consecutive 64-row tiles of one expert): the
    copy engine multicasts each tile (`MosaicTiles.cluster`). Off by default: on an H200 it made
    every call slower (`default_tiles`).
  * A block's items (an x tile of its expert's rows x one of its 64-row weight tiles) run one
    pipeline each, chained (Pallas' pipeline of pipelines), so that the producer fetches the next
    item while the consumer finishes this one: a grouped block chains all of its expert's tiles at
    decode (`default_grouped_tiles`), and pays a block's fixed cost (3.5 us on an H200) once. An
    expert whose rows take two x tiles gives the second its own block (`MosaicTiles.pass_lanes`). The
    blocks that then have nothing (most second lanes) cost 5-8 us a call on an H200; with
    `MosaicTiles.early_exit` (off until timed) they end after one load of their group size.
  * Where K leaves no 512-wide step (K = 768: the down projection), a step takes 256 of K on two
    64-row tiles (`MosaicTiles.row_tiles`): one x tile and one set of wgmma descriptors for both, so
    that the loop's fixed cost is spread over as many weights as a 512-wide step. A grouped call with
    x tiles of 32 rows takes them at other K too (`default_grouped_tiles`): x, then more bytes per
    step than a tile's weights, is read through L2 once per 128 weight rows, not 64 (a model's
    gain, not yet timed).
  * Two consumer warpgroups per block (`MosaicTiles.compute_wgs = 2`; the default at block_m 16 and
    64, measured faster on an H200: `default_tiles`): each decodes and multiplies half of every
    step's K into its own accumulator, and the two sums meet once per item, through shared memory
    between two named-barrier syncs (`_sum_warpgroups`). A block's serial chain per step (wait,
    decode, 32 dependent wgmmas, wait) is halved and two of them run at once on each SM
    sub-partition, for the same grid. Each warpgroup gets 216 registers (168 at launch; the
    producer keeps 72: `_registers_fit`), and a step of 1024 keeps 512 per warpgroup (2.52
    instructions per weight, against 2.70 at 512). Both wait for the same step, so they decode together
    and then multiply together; `MosaicTiles.ping_pong` (off until timed) makes them take turns at the
    MMAs (two named barriers), so that one decodes while the other's MMAs run.
  * A warpgroup's share of a step can be decoded and multiplied in parts (`MosaicTiles.parts`, off:
    on an H200 mostly slower, and always slower than two warpgroups): one wgmma group per part,
    and a wait for the group before the last one, so that part p + 1's decode runs while part p's
    MMAs do (the compiled loop keeps them in distinct registers: `WARPGROUP.DEPBAR.LE gsb0, 0x1`
    between the parts). Unlike `overlap` it stays within a step, so that chained items (grouped
    blocks) can use it. 2 parts of 256: 2.52 instructions per weight.
  * `MosaicTiles.overlap` carries the last part's MMAs into the next step (its slot is released a step
    later), so that the next step's first decode runs while they do. It needs two parts or more: with
    one, each step's decode writes the very registers that the previous step's MMAs, still in flight,
    read. PTX leaves that undefined, and ptxas lets it happen (the HGMMA takes no read or write barrier
    on its registers): `gpu_compile.inflight_register_writes` finds 93-379 such writes in that loop (by
    shape and tiles) and none with two parts, and tests/test_gpu_compile.py holds every kernel here to none.

pallas_kernels/lab/kernel_report.py counts the compiled loop (pallas_kernels/gpu_compile.py compiles it
for sm_90a without a GPU): 2.48-2.49 SASS instructions per weight, against 6.6
for the Pallas-Triton kernel. The rollout engine runs it on Hopper (rollout.expert_layout);
`unpack_fragments` inverts the packing, for the jnp reference.

Measured on an H200 (jax 0.11.2, device time: docs/gpu_check/h200-2026-12-04b-* to -04f-*; docs/gpu.md):
every GPU test here passed in run c; in run f the grouped ones (pass lanes, four row tiles) passed again.
K = N = 8192 at the default tiles: 15.9 us at M = 1, 16.0 at M = 8, 22.9 at M = 64, against 33.8-40.3 us for
XLA's bf16 dot (2.1x, 2.2x, 1.8x); at K = 32768, M = 8: 2.37x.
A block costs 3.5 us fixed and then 0.77 us per 512-wide step (3.0 TB/s of FP4 bytes over 128 SMs; the
bf16 dot streams 4.4). More weight bytes in flight per SM (5 slots, or x tiles of 8 rows with 7) were no
faster; with the decode replaced by register moves the call is a fifth faster (a step a quarter). Grouped, 64
tokens top-8 of 128 experts: 87.8 us (gate_up) and 53.4 us (down) at the default tiles, 2.35x and 2.78x our bf16
Triton grouped kernel. `MosaicTiles.overlap` in one part (the form those runs timed, since refused) gained up
to 5% at block_m 16 with one warpgroup, and gave wrong sums with two and NaN at block_m 64, which the in-flight
register writes above explain. Overlap in two parts has not run on a GPU yet: it will say whether they were the
cause.

CPU: the kernel needs an sm_90 GPU (Mosaic GPU has no interpret mode for inline Mosaic code); the
packing and a numpy emulation of the register decode (`decode_fragments_numpy`, instruction by
instruction) run anywhere, and tests/test_fp4_mosaic.py checks the emulation bit for bit against
`fp4.dequantize`, and on a GPU the kernel against the Triton kernels' jnp references
(`fp4_matmul.fp4_matmul_reference`, `grouped_fp4_matmul.grouped_fp4_matmul_reference`;
pallas_kernels/lab/gpu_check.py runs those tests).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import fp4

ROWS = 64  # weight rows per warpgroup (the wgmma M)
CHUNK = 16  # K per wgmma instruction, = the NVFP4 block
GROUP_K = 4 * CHUNK  # K per 16-byte load of a thread's codes
SCALE_GROUP_K = 2 * GROUP_K  # K per 16-byte load of a quad's scales
THREADS = 128
QUADS = THREADS // 4
SCALE_EXPONENT = 119  # the UE5M3 byte's bf16 value is the E4M3 scale times 2^119
CODE_EXPONENT = -126  # decode_word gives E2M1 values times 2^-126
RESULT_EXPONENT = -(SCALE_EXPONENT + CODE_EXPONENT)  # f32 result * 2^7 = x @ W^T
SCALE_BIAS_BITS = 0x7000  # bf16 exponent bits 14-12, or-ed onto u << 4

# Byte-permute selectors: register o of a fragment takes bytes (2*(o%2), 2*(o%2)+1) of L and H.
_PRMT = (0x5140, 0x7362)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FragmentWeight:
  """An NVFP4 weight [N, K] packed for `fp4_matmul_mosaic` (see the module docstring)."""

  # int32 [N/64, K/128, 9, 128]: per 64 rows and 128 K, 1024 code words (2 K/64 groups x 128
  # threads x 4 chunks) then 128 scale words (32 quads x 4): one stream, one copy per step.
  words: jax.Array
  tensor_scale: jax.Array | None  # float32 scalar, or None

  @property
  def shape(self) -> tuple[int, ...]:
    """[N, K], or [E, N, K] for stacked experts (words [E, N/64, K/128, 9, 128])."""
    *lead, row_tiles, k_groups = self.words.shape[:-2]
    return (*lead, row_tiles * ROWS, k_groups * SCALE_GROUP_K)

  @property
  def nbytes(self) -> int:
    return self.words.size * 4

  @property
  def codes(self) -> jax.Array:
    """int32 [(E,) N/64, K/64, 128 threads, 4 chunks]."""
    *lead, n, k = self.shape
    return self.words[..., :8, :].reshape(*lead, n // ROWS, k // GROUP_K, THREADS, 4)

  @property
  def scales(self) -> jax.Array:
    """int32 [(E,) N/64, K/128, 128]: per quad 4 words of UE5M3 bytes (rows r, r + 8) x 2 chunks."""
    return self.words[..., 8, :]


def unsupported(fmt: str, n: int, k: int) -> str | None:
  """Why the kernel cannot take an [N, K] weight in format `fmt`, or None."""
  if fmt != "nvfp4":
    return f"the Mosaic FP4 kernel takes NVFP4 weights, not {fmt}"
  if n % ROWS or k % SCALE_GROUP_K:
    return f"the Mosaic FP4 kernel needs N a multiple of {ROWS} and K of {SCALE_GROUP_K}, got [{n}, {k}]"
  return None


# --- where each code bit goes -----------------------------------------------------------------
#
# Register o (0..3) of a chunk's fragment holds two weights e = 0 (low half) and 1 (high half). It
# is prmt(L, H) of two cleaned copies of the word: L = L0 (o < 2) or L1, H = H0 or H1, bytes
# b = 2 * (o % 2) + e:
#   L0 = q & 0xC0C0C0C0         byte b bits 7, 6 = q bits 8b+7, 8b+6    (exponent bit 0, mantissa)
#   L1 = (q << 2) & 0xC0C0C0C0  byte b bits 7, 6 = q bits 8b+5, 8b+4
#   H0 = rotr(q, 1) & 0x81818181  byte b bit 7 = q bit 8b+8 (mod 32), bit 0 = q bit 8b+1  (sign, exponent bit 1)
#   H1 = rotr(q, 3) & 0x81818181  byte b bit 7 = q bit 8b+10 (mod 32), bit 0 = q bit 8b+3
# so the bf16 half gets the sign on bit 15, exponent bits on 8 and 7 and the mantissa on 6.


def _bit_positions(o: int, e: int) -> dict[str, int]:
  b, pair = 2 * (o % 2) + e, o // 2
  mantissa = 8 * b + 6 - 2 * pair
  return dict(m=mantissa, e0=mantissa + 1, e1=8 * b + 1 + 2 * pair, s=(8 * b + 8 + 2 * pair) % 32)


def _check_bit_layout():
  used = sorted(p for o in range(4) for e in range(2) for p in _bit_positions(o, e).values())
  assert used == list(range(32)), used


_check_bit_layout()


# --- packing (weight sync; jnp, runs under jit on any backend) ----------------------------------


def _fragment_order(a: jax.Array, n: int, k: int) -> jax.Array:
  """[N, K] -> [N/64, K/64, 128 threads, 4 chunks, 4 registers o, 2 halves e]."""
  # row = 64 i + 16 w + 8 (o % 2) + lane // 4 ; col = 64 kg + 16 j + 8 (o // 2) + 2 (lane % 4) + e
  a = a.reshape(n // ROWS, 4, 2, 8, k // GROUP_K, 4, 2, 4, 2)  # i, w, oh, rl, kg, j, ol, c, e
  a = a.transpose(0, 4, 1, 3, 7, 5, 6, 2, 8)  # i, kg, w, rl, c, j, ol, oh, e
  return a.reshape(n // ROWS, k // GROUP_K, THREADS, 4, 4, 2)  # (ol, oh) -> o = 2 ol + oh


def _scale_order(s: jax.Array, n: int, k: int) -> jax.Array:
  """UE5M3 bytes [N, K/16] -> words [N/64, K/128, 32 quads x 4] (flat: TMA wants 16-byte strides).
  Word 2g + h of a quad holds the K/64 group g's chunks 2h and 2h + 1: rows r at bits 11-4 and 27-20 (their bf16
  places, or-ed with the bias), rows r + 8 split into nibbles so that a rotation by 8 moves them
  there: chunk 2h's high nibble at bits 3-0 and low nibble at 31-28, chunk 2h + 1's at 19-16 and
  15-12. Two scale registers cost three ops (`decode_scales`)."""
  s = s.reshape(n // ROWS, 4, 2, 8, k // GROUP_K, 2, 2)  # i, w, oh, rl, kg, h, jj
  s = s.transpose(0, 4, 1, 3, 5, 2, 6).reshape(n // ROWS, k // GROUP_K, QUADS, 2, 2, 2).astype(jnp.uint32)
  r_even, r_odd, r8_even, r8_odd = s[..., 0, 0], s[..., 0, 1], s[..., 1, 0], s[..., 1, 1]
  word = r_even << 4 | r_odd << 20
  word |= (r8_even >> 4) | (r8_even & 0xF) << 28 | (r8_odd >> 4) << 16 | (r8_odd & 0xF) << 12
  word = word.reshape(n // ROWS, k // SCALE_GROUP_K, 2, QUADS, 2).transpose(0, 1, 3, 2, 4)
  return jax.lax.bitcast_convert_type(word, jnp.int32).reshape(n // ROWS, k // SCALE_GROUP_K, 4 * QUADS)


def ue5m3_from_e4m3(scales: jax.Array) -> jax.Array:
  """E4M3 scales -> (UE5M3 bytes as uint32, negative?, zero?) with bf16(0x7000 | u << 4) = |scale| * 2^119."""
  s = scales.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(jnp.abs(s) * 2.0**SCALE_EXPONENT, jnp.uint32)
  return (bits >> 20) & 0xFF, s < 0, s == 0


@jax.jit
def pack_fragments(w: fp4.QuantizedArray) -> FragmentWeight:
  """Permute an NVFP4 `QuantizedArray` [N, K] (or stacked experts [E, N, K]) into the kernel's
  fragment layout (exact: see the module docstring for zero and negative scales)."""
  if w.codes.ndim not in (2, 3):
    raise ValueError(
      f"pack_fragments: expected a weight [N, K/2] or experts [E, N, K/2], got codes of shape {w.codes.shape}."
    )
  if why := unsupported(w.fmt.name, *w.shape[-2:]):
    raise ValueError(f"pack_fragments: {why}; use pallas_kernels.fp4_matmul (Triton) for other weights.")
  ts = w.tensor_scale
  if ts is not None and ts.size not in (1, w.codes.shape[0] if w.codes.ndim == 3 else 1):
    raise ValueError("pack_fragments: a per-row tensor scale is not supported; give one scale per tensor (or expert).")
  if w.codes.ndim == 3:
    experts = w.codes.shape[0]
    ts = None if ts is None else jnp.broadcast_to(ts.reshape(-1), (experts,)).astype(jnp.float32)
    one = lambda codes, scales: _pack_one(fp4.QuantizedArray(codes, scales, None, w.fmt))
    return FragmentWeight(jax.vmap(one)(w.codes, w.scales).words, ts)
  return _pack_one(w)


def _pack_one(w: fp4.QuantizedArray) -> FragmentWeight:
  n, k = w.shape
  u, negative, zero = ue5m3_from_e4m3(w.scales)
  codes = fp4.to_blocks(fp4.unpack_nibbles(w.codes).astype(jnp.uint32), w.fmt)  # [N, K/16, 16]
  flip = jnp.where(negative, jnp.uint32(8), jnp.uint32(0))[..., None]
  codes = jnp.where(zero[..., None], jnp.uint32(0), codes ^ flip).reshape(n, k)
  frag = _fragment_order(codes, n, k)
  word = jnp.zeros(frag.shape[:4], jnp.uint32)
  for o in range(4):
    for e in range(2):
      code = frag[..., o, e]
      for name, bit in (("m", 0), ("e0", 1), ("e1", 2), ("s", 3)):
        word = word | (((code >> bit) & 1) << _bit_positions(o, e)[name])
  tensor_scale = None if w.tensor_scale is None else w.tensor_scale.reshape(()).astype(jnp.float32)
  codes = jax.lax.bitcast_convert_type(word, jnp.int32).reshape(n // ROWS, k // SCALE_GROUP_K, 8, THREADS)
  words = jnp.concatenate([codes, _scale_order(u, n, k)[:, :, None]], axis=2)
  return FragmentWeight(words, tensor_scale)


@jax.jit
def unpack_fragments(w: FragmentWeight) -> fp4.QuantizedArray:
  """The NVFP4 `QuantizedArray` [(E,) N, K] that `pack_fragments` packed into `w` (jnp, any backend):
  the same values (a block whose scale was negative comes back with a positive scale and flipped code
  signs, one whose scale was zero with codes +0), bit-identical codes and scales otherwise. What the
  kernel's jnp reference multiplies (`pallas_kernels.grouped_packed_matmul(impl='reference')`)."""
  if w.words.ndim == 5:
    ts = w.tensor_scale
    one = lambda words: _unpack_one(FragmentWeight(words, None))
    q = jax.vmap(one)(w.words)
    return fp4.QuantizedArray(q.codes, q.scales, None if ts is None else ts.reshape(-1, 1, 1), q.fmt)
  return _unpack_one(w)


def _unpack_one(w: FragmentWeight) -> fp4.QuantizedArray:
  n, k = w.shape
  word = jax.lax.bitcast_convert_type(w.codes, jnp.uint32)  # [N/64, K/64, 128, 4 chunks]
  nibbles = jnp.zeros((*word.shape, 4, 2), jnp.uint32)  # [..., o, e]
  for o in range(4):
    for e in range(2):
      code = sum(
        ((word >> _bit_positions(o, e)[name]) & 1) << bit for name, bit in (("m", 0), ("e0", 1), ("e1", 2), ("s", 3))
      )
      nibbles = nibbles.at[..., o, e].set(code)
  # [i, kg, (w, rl, c), j, (ol, oh), e] -> [N, K], the inverse of _fragment_order
  codes = nibbles.reshape(n // ROWS, k // GROUP_K, 4, 8, 4, 4, 2, 2, 2).transpose(0, 2, 7, 3, 1, 5, 6, 4, 8)
  codes = fp4.pack_nibbles(codes.reshape(n, k))
  # the inverse of _scale_order: words [i, K/128, (quad, g, h)] -> UE5M3 bytes [N, K/16]
  s = jax.lax.bitcast_convert_type(w.scales, jnp.uint32).reshape(n // ROWS, k // SCALE_GROUP_K, QUADS, 2, 2)
  s = s.transpose(0, 1, 3, 2, 4).reshape(n // ROWS, k // GROUP_K, QUADS, 2)  # [i, kg, quad, h]
  r_even, r_odd = (s >> 4) & 0xFF, (s >> 20) & 0xFF
  r8_even, r8_odd = (s & 0xF) << 4 | (s >> 28) & 0xF, ((s >> 16) & 0xF) << 4 | (s >> 12) & 0xF
  u = jnp.stack([jnp.stack([r_even, r_odd], -1), jnp.stack([r8_even, r8_odd], -1)], -2)  # [i, kg, quad, h, oh, jj]
  u = u.reshape(n // ROWS, k // GROUP_K, 4, 8, 2, 2, 2).transpose(0, 2, 5, 3, 1, 4, 6).reshape(n, k // CHUNK)
  bf16 = jax.lax.bitcast_convert_type((SCALE_BIAS_BITS | u << 4).astype(jnp.uint16), jnp.bfloat16)
  scales = (bf16.astype(jnp.float32) * 2.0**-SCALE_EXPONENT).astype(jnp.float8_e4m3fn)  # exact; a zero block's: 0
  return fp4.QuantizedArray(codes, scales, w.tensor_scale, fp4.NVFP4)


# --- the register decode, instruction by instruction (numpy, for tests; the kernel's PTX below) --


def _u32(x) -> np.ndarray:
  return np.asarray(x).astype(np.uint32)


def _prmt(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
  pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
  out = np.zeros_like(a)
  for byte in range(4):
    out |= pool[(selector >> (4 * byte)) & 0x7] << (8 * byte)
  return out


def _rotr(q: np.ndarray, n: int) -> np.ndarray:
  return (q >> n) | (q << (32 - n))


def decode_word(q: np.ndarray) -> list[np.ndarray]:
  """The four bf16x2 registers (as uint32) of one code word, as `_DECODE_PTX` computes them."""
  q = _u32(q)
  l0, l1 = q & 0xC0C0C0C0, (q << 2) & 0xC0C0C0C0
  h0, h1 = _rotr(q, 1) & 0x81818181, _rotr(q, 3) & 0x81818181
  return [_prmt(l0, h0, _PRMT[0]), _prmt(l0, h0, _PRMT[1]), _prmt(l1, h1, _PRMT[0]), _prmt(l1, h1, _PRMT[1])]


def decode_scales(word: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(rows r, rows r + 8) bf16x2 scale registers of one scale word: chunk 2h in the low half,
  chunk 2h + 1 in the high half, as `_SCALE_PTX` computes them."""
  w = _u32(word)
  bias = SCALE_BIAS_BITS | SCALE_BIAS_BITS << 16
  return (w & 0x0FF00FF0) | bias, (_rotr(w, 24) & 0x0FF00FF0) | bias


def _bf16_values(bits16: np.ndarray) -> np.ndarray:
  return (_u32(bits16) << 16).view(np.float32).astype(np.float64)  # numpy keeps subnormals


def _half(reg: np.ndarray, h: int) -> np.ndarray:
  return (reg >> (16 * h)) & 0xFFFF


def decode_fragments_numpy(w: FragmentWeight) -> np.ndarray:
  """float64 [N, K]: what the kernel's registers hold (weights times 2^-7, no tensor scale),
  emulating its integer ops bit for bit and its bf16 multiply exactly (products are exact; an
  AssertionError says otherwise)."""
  codes, scales = _u32(np.asarray(w.codes).view(np.uint32)), _u32(np.asarray(w.scales).view(np.uint32))
  n, k = w.shape
  regs = np.stack(decode_word(codes), -1)  # [i, kg, t, j, o]
  out = np.zeros(regs.shape + (2,))
  scales = scales.reshape(n // ROWS, k // SCALE_GROUP_K, QUADS, 2, 2).transpose(0, 1, 3, 2, 4)
  scales = scales.reshape(n // ROWS, k // GROUP_K, QUADS, 2)
  quad_scales = [decode_scales(scales[..., h]) for h in range(2)]  # [i, kg, quad] each
  for j in range(4):
    rows_r, rows_r8 = quad_scales[j // 2]
    for o in range(4):
      scale_reg = rows_r if o % 2 == 0 else rows_r8
      scale = np.repeat(_bf16_values(_half(scale_reg, j % 2)), 4, axis=-1)  # quad -> its 4 threads
      for e in range(2):
        out[..., j, o, e] = _bf16_values(_half(regs[..., j, o], e)) * scale
  finite = np.isfinite(out)
  rounded = out[finite].astype(np.float32).astype(jnp.bfloat16).astype(np.float64)
  assert np.array_equal(rounded, out[finite]), "a product is not exact in bf16"
  # [i, kg, (w, rl, c), j, (ol, oh), e] -> [N, K]
  out = out.reshape(n // ROWS, k // GROUP_K, 4, 8, 4, 4, 2, 2, 2)  # i, kg, w, rl, c, j, ol, oh, e
  return out.transpose(0, 2, 7, 3, 1, 5, 6, 4, 8).reshape(n, k)


# --- the kernel ----------------------------------------------------------------------------------


# PTX: code word $4, scale registers $5 (rows r) and $6 (rows r + 8) already broadcast -> the
# fragment's four bf16x2 registers $0..$3.
_DECODE_PTX = f"""{{
.reg .b32 l0, l1, h0, h1, t;
and.b32 l0, $4, 0xC0C0C0C0;
shl.b32 l1, $4, 2;
and.b32 l1, l1, 0xC0C0C0C0;
shf.r.wrap.b32 h0, $4, $4, 1;
and.b32 h0, h0, 0x81818181;
shf.r.wrap.b32 h1, $4, $4, 3;
and.b32 h1, h1, 0x81818181;
prmt.b32 t, l0, h0, {_PRMT[0]:#06x};
mul.rn.bf16x2 $0, t, $5;
prmt.b32 t, l0, h0, {_PRMT[1]:#06x};
mul.rn.bf16x2 $1, t, $6;
prmt.b32 t, l1, h1, {_PRMT[0]:#06x};
mul.rn.bf16x2 $2, t, $5;
prmt.b32 t, l1, h1, {_PRMT[1]:#06x};
mul.rn.bf16x2 $3, t, $6;
}}"""


# PTX: scale word $4, bias word $5 -> broadcast bf16x2 scales: $0 rows r chunk 2h, $1 rows r chunk
# 2h+1, $2 rows r+8 chunk 2h, $3 rows r+8 chunk 2h+1. (The bias is an operand so that each and-or is
# one lop3 with the mask as its immediate; the broadcasts become operand selectors (.H0_H0 /
# .H1_H1) of the multiplies.)
_SCALE_PTX = """{
.reg .b32 e, o;
.reg .b16 e0, e1, o0, o1;
lop3.b32 e, $4, 0x0FF00FF0, $5, 0xEA;
shf.l.wrap.b32 o, $4, $4, 8;
lop3.b32 o, o, 0x0FF00FF0, $5, 0xEA;
mov.b32 {e0, e1}, e;
mov.b32 {o0, o1}, o;
mov.b32 $0, {e0, e0};
mov.b32 $1, {e1, e1};
mov.b32 $2, {o0, o0};
mov.b32 $3, {o1, o1};
}"""


def _decode_tile(width: int, tile: int = 0, first_group: int = 0, wg_groups: int = 0):
  """inline_mgpu function: (the words' smem block [row_tiles, block_k/128, 9, 128]) -> `width` of K
  of its 64-row tile `tile`, bf16 [64, width] (times 2^-7) in registers, wgmma layout: the K/128
  groups from first_group + w * wg_groups on, for compute warpgroup w (its index comes from the
  thread index: no argument; wg_groups = 0 with one compute warpgroup)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, vector
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def decode(_, words_ref):
    i32 = ir.IntegerType.get_signless(32)
    index = ir.IndexType.get()
    bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
    thread = mgpu_utils.thread_idx()
    tid = arith.remui(thread, mgpu_utils.c(THREADS, i32))
    group0 = None  # the warpgroup's first K group
    if wg_groups:
      wg = arith.divui(thread, mgpu_utils.c(THREADS, i32))
      group0 = arith.index_cast(index, arith.muli(wg, mgpu_utils.c(wg_groups, i32)))
    row_of_thread = arith.index_cast(index, arith.shrui(tid, mgpu_utils.c(5, i32)))
    col_of_thread = arith.index_cast(index, arith.shli(arith.andi(tid, mgpu_utils.c(31, i32)), mgpu_utils.c(2, i32)))
    quad_words = arith.index_cast(index, arith.shli(arith.shrui(tid, mgpu_utils.c(2, i32)), mgpu_utils.c(2, i32)))
    tile_index = mgpu_utils.c(tile, index)
    layout = fa.WGMMA_LAYOUT
    registers = np.empty(layout.registers_shape((ROWS, width)), dtype=object)
    four = llvm.StructType.get_literal([i32] * 4)
    bias = mgpu_utils.c(SCALE_BIAS_BITS | SCALE_BIAS_BITS << 16, i32)

    def asm(text, args):
      out = llvm.inline_asm(four, args, text, "=r,=r,=r,=r," + ",".join("r" * len(args)))
      return [llvm.extractvalue(i32, out, [i]) for i in range(4)]

    for kg in range(width // GROUP_K):
      group = mgpu_utils.c(first_group + kg // 2, index)
      if group0 is not None:
        group = arith.addi(group0, group)
      row = arith.addi(row_of_thread, mgpu_utils.c(4 * (kg % 2), index))
      words = vector.load(ir.VectorType.get((4,), i32), words_ref, [tile_index, group, row, col_of_thread])
      if kg % 2 == 0:
        scale_words = vector.load(
          ir.VectorType.get((4,), i32), words_ref, [tile_index, group, mgpu_utils.c(8, index), quad_words]
        )
      for h in range(2):
        scale_word = vector.extract(scale_words, [], [2 * (kg % 2) + h])
        r_even, r_odd, r8_even, r8_odd = asm(_SCALE_PTX, [scale_word, bias])
        for jj, (s_r, s_r8) in enumerate(((r_even, r8_even), (r_odd, r8_odd))):
          j = 2 * h + jj
          chunk = 4 * kg + j
          regs = asm(_DECODE_PTX, [vector.extract(words, [], [j]), s_r, s_r8])
          for o, reg in enumerate(regs):
            registers[0, 2 * chunk + o // 2, 0, 0, o % 2, 0, 0, 0, 0] = mgpu_utils.bitcast(reg, bf16x2)
    return mgpu.FragmentedArray(_registers=registers, _layout=layout, _is_signed=None)

  return plgpu.inline_mgpu(
    arg_types=(plgpu.RefType(),),
    return_type=plgpu.ShapeDtypeStruct((ROWS, width), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
  )(decode)


# a named barrier of the compute warpgroups (Mosaic's warpgroup barriers take 1-4; 0 is the block's)
REDUCE_BARRIER = 15
# MosaicTiles.ping_pong: "warpgroup w's turn at the MMAs has ended", w = 0, 1 (named barriers of 256 threads)
TURN_BARRIERS = (13, 14)


def _turn(kind: str):
  """inline_mgpu function of no operands (MosaicTiles.ping_pong: the two compute warpgroups' MMAs take turns).
  Warpgroup w waits for the other's turn to end ("wait": bar.sync on the other's barrier) and ends its own
  ("end": bar.arrive on its own); "start" and "finish" balance the barriers around an item's steps (warpgroup 1
  ends a turn before the first step; warpgroup 0 waits for its last). Each bar.sync meets one bar.arrive of the
  other warpgroup (128 + 128 threads), so a warpgroup's turn s + 1 waits for the other's turn s, which waits
  for its own turn s: they alternate, and neither arrives twice before the other has waited."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax.experimental.pallas import mosaic_gpu as plgpu

  ops = {
    "wait": f"@p bar.sync {TURN_BARRIERS[1]}, 256; @!p bar.sync {TURN_BARRIERS[0]}, 256;",  # wg 0 waits for wg 1's
    "end": f"@p bar.arrive {TURN_BARRIERS[0]}, 256; @!p bar.arrive {TURN_BARRIERS[1]}, 256;",
    "start": f"@!p bar.arrive {TURN_BARRIERS[1]}, 256;",
    "finish": f"@p bar.sync {TURN_BARRIERS[1]}, 256;",
  }[kind]

  def turn(_):
    i32 = ir.IntegerType.get_signless(32)
    wg = arith.divui(mgpu_utils.thread_idx(), mgpu_utils.c(THREADS, i32))
    llvm.inline_asm(
      ir.Type.parse("!llvm.void"),
      [wg],
      "{ .reg .pred p; setp.eq.u32 p, $0, 0; " + ops + " }",
      "r,~{memory}",
      has_side_effects=True,
    )

  return plgpu.inline_mgpu()(turn)


def _sum_warpgroups(block_m: int, compute_wgs: int):
  """inline_mgpu function: (acc [64, block_m] f32 in wgmma layout, each compute warpgroup its partial
  sum over its share of K; scratch smem f32 [registers, 128, 2]) -> the sum over the warpgroups, in
  warpgroup 0 (warpgroup 1 gets twice its own back, unused: only warpgroup 0 stores). Warpgroup 1
  writes its registers where its thread's twin in warpgroup 0 reads them (thread-private slots, no
  bank conflicts), between two named-barrier syncs of the 256 threads (the second keeps the next
  item's write behind this read)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, scf, vector
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax.experimental.pallas import mosaic_gpu as plgpu

  if compute_wgs != 2:
    raise NotImplementedError(f"_sum_warpgroups: 2 compute warpgroups, got {compute_wgs}")

  def reduce(_, acc, scratch):
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    f32x2 = ir.VectorType.get((2,), ir.F32Type.get())
    thread = mgpu_utils.thread_idx()
    lane = arith.index_cast(index, arith.remui(thread, mgpu_utils.c(THREADS, i32)))
    second = arith.cmpi(arith.CmpIPredicate.uge, thread, mgpu_utils.c(THREADS, i32))
    flat = list(np.ndenumerate(acc.registers))

    def sync():
      llvm.inline_asm(
        ir.Type.parse("!llvm.void"),
        [],
        f"bar.sync {REDUCE_BARRIER}, {THREADS * compute_wgs};",
        "",
        has_side_effects=True,
      )

    branch = scf.IfOp(second)
    with ir.InsertionPoint(branch.then_block):
      for i, (_, reg) in enumerate(flat):
        vector.store(reg, scratch, [mgpu_utils.c(i, index), lane, mgpu_utils.c(0, index)])
      scf.yield_([])
    sync()
    registers = np.empty(acc.registers.shape, dtype=object)
    for i, (idx, reg) in enumerate(flat):
      other = vector.load(f32x2, scratch, [mgpu_utils.c(i, index), lane, mgpu_utils.c(0, index)])
      registers[idx] = arith.addf(reg, other)
    sync()
    return mgpu.FragmentedArray(_registers=registers, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return plgpu.inline_mgpu(
    arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
    return_type=plgpu.ShapeDtypeStruct((ROWS, block_m), jnp.float32, layout=plgpu.Layout.WGMMA),
  )(reduce)


def _store_rows(block_m: int, out_dtype):
  """inline_mgpu function: (acc [64, block_m] f32 (wgmma layout), the tile's first row, lo, hi, first
  column, scale: int32 / f32 scalars; out gmem [M, N]) -> out[row0 + t, col0 + r] = acc[r, t] * scale
  * 2^7 for lo <= t < hi: one expert's rows of a tile, written where they belong and nowhere else."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, memref, scf, vector
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def store(_, acc, row0, lo, hi, col0, scale, out_ref):
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    out_type = mgpu_utils.dtype_to_ir_type(out_dtype)
    row0, lo, hi, col0, scale = (a.registers.flat[0] for a in (row0, lo, hi, col0, scale))
    two_7 = arith.constant(ir.F32Type.get(), ir.FloatAttr.get(ir.F32Type.get(), 2.0**RESULT_EXPONENT))
    scale = arith.mulf(scale, two_7)
    tid = arith.remui(mgpu_utils.thread_idx(), mgpu_utils.c(THREADS, i32))
    lane = arith.andi(tid, mgpu_utils.c(31, i32))
    row = arith.addi(
      arith.shli(arith.shrui(tid, mgpu_utils.c(5, i32)), mgpu_utils.c(4, i32)), arith.shrui(lane, mgpu_utils.c(2, i32))
    )
    col = arith.shli(arith.andi(lane, mgpu_utils.c(3, i32)), mgpu_utils.c(1, i32))
    for idx, reg in np.ndenumerate(acc.registers):
      j, h = idx[1], idx[4]
      r = arith.index_cast(index, arith.addi(col0, arith.addi(row, mgpu_utils.c(8 * h, i32))))
      for e in range(2):
        t = arith.addi(col, mgpu_utils.c(8 * j + e, i32))
        inside = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, t, lo), arith.cmpi(arith.CmpIPredicate.slt, t, hi))
        branch = scf.IfOp(inside)
        with ir.InsertionPoint(branch.then_block):
          value = arith.mulf(vector.extract(reg, [], [e]), scale)
          if out_type != value.type:
            value = arith.truncf(out_type, value)
          memref.store(value, out_ref, [arith.index_cast(index, arith.addi(row0, t)), r])
          scf.yield_([])

  scalar = plgpu.Layout.WG_SPLAT(shape=())
  return plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, *[scalar] * 5, plgpu.RefType()))(store)


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
  block_m: int  # tokens per wgmma (its N): a multiple of 8 up to 64 (x's copies are tiled 8 rows deep)
  block_k: int  # K per pipeline step (the decoded tile: block_k / 4 registers per thread)
  max_concurrent_steps: int = 4  # pipeline slots
  cluster: int = 1  # blocks of consecutive 64-row tiles (one expert's) that share each x tile: TMA multicast
  tiles_per_block: int = 1  # row units (below) a block computes one after the other (chained pipelines)
  row_tiles: int = 1  # 64-row weight tiles each pipeline step decodes and multiplies by its one x tile (a row unit)
  overlap: bool = False  # a step's decode overlaps the previous step's MMAs (its slot is released a step later):
  #                       needs parts >= 2, so that the registers a part decodes into are not those still in flight
  compute_wgs: int = 1  # consumer warpgroups per block, each 1 / compute_wgs of every step's K (summed at the end)
  parts: int = 1  # a warpgroup's K of a step is decoded and multiplied in this many parts, part p + 1's decode
  #                 overlapping part p's MMAs (one wgmma group each, at most two in flight)
  pass_lanes: int = 1  # grouped: blocks per (expert, row units) that share its passes (x tiles), lane j taking
  #                      passes j, j + pass_lanes, ...: an expert whose rows take two passes is not one block's
  #                      double work (a lane without a pass copies nothing, after the prologue)
  ping_pong: str = ""  # compute_wgs = 2: the warpgroups take turns at the tensor cores (named barriers), so that one
  #                     decodes while the other's MMAs run (else both decode, then both multiply, in step): a warpgroup
  #                     issues a step's MMAs once the other has "issued" its own, or once they are "done"; "": off
  early_exit: bool = False  # a block whose expert has no rows, or too few for its lane (lane x block_m >= 7 + rows),
  #                           ends after one load (after Mosaic's barrier setup, before the prologue's sum over the
  #                           experts before it); not yet timed on a GPU (mosaic_variants.py has the rows)


SMEM_BUDGET = 200 * 1024  # of the H200's 227 KiB per block: the pipeline's slots (the rest: barriers, scratch)


# The producer warpgroup's registers (setmaxnreg), by the consumer warpgroups: one consumer gets 256 either way;
# 40 (jax's default) spills the chained pipelines' loop state in the producer, and so does 56 with two consumers
# (48 bytes at 256 tokens, K = 768). Two consumers get (512 - this) / 2, down to a multiple of 8, and the sum must
# fit the block's launch pool of 3 x 168 (`_registers_fit`): 40, 56, 72 do (232, 224, 216 each), 48 and 64 do not.
MEMORY_REGISTERS = {1: 64, 2: 72}  # by compute_wgs


def _registers_fit(compute_wgs: int) -> bool:
  """setmaxnreg moves registers within the block's launch pool (ptxas: 65536 / threads, down to a multiple of
  8, at most 255 each): the producer's plus the consumers' (Pallas: min(256, (512 - producer) / compute_wgs),
  down to a multiple of 8) must fit it, or a consumer warp's setmaxnreg.inc waits forever (a hang, not an
  error). 3 warpgroups start with 168 each (504 per thread triple): 72 + 2 x 216 fits, 64 + 2 x 224 does not."""
  launch = min(255, 65536 // (THREADS * (compute_wgs + 1)) // 8 * 8)
  producer = MEMORY_REGISTERS[compute_wgs]
  consumer = int(min(256, (512 - producer) / compute_wgs) // 8 * 8)
  return producer + compute_wgs * min(consumer, 255) <= launch * (compute_wgs + 1)


# block_m where two compute warpgroups were timed faster and right on an H200 (default_tiles). At 32 (grouped,
# 256 tokens) the only timed call ran past 45 s in XLA's compile of the timed function, after the checked call
# had run and returned: unexplained, so one warpgroup stays the default there until it is timed.
TWO_WARPGROUPS_BLOCK_M = (16, 64)
WAVES = 2  # blocks per SM (132 on an H200) a call keeps at least, when its blocks take more rows (below)
SMS = 132


def default_tiles(m: int, k: int, n: int = 0, experts: int = 1) -> MosaicTiles:
  """Tiles for x [M, K] times `experts` weights [N, K] (the experts with rows, at most).
  block_m: M rounded up to 16..64 (wgmma's N). block_k: the largest of 512, 384, 256, 128 that
  divides K in 2 steps or more (the loop's fixed cost is spread over more weights; 768 spills, its
  48 wgmmas' descriptors move out of the uniform registers; a single step leaves nothing to pipeline).
  Below 512, a step of 256 on two 64-row tiles (row_tiles 2: one x tile, 16 descriptors, for both)
  where 256 divides K and the grid keeps WAVES blocks per SM: at K = 768, 2.48 instructions per
  weight against 2.55 for one tile at 384 (two tiles at 384 copy their 24 descriptors: 2.54; at 512
  they spill).
  As many pipeline slots (up to 4) as fit and divide the steps (chained pipelines): 2 at block_m = 64.
  Two compute warpgroups (each half of every step's K) where the halves are whole 128-wide scale groups:
  on an H200 (device time, docs/gpu_check/h200-2026-12-04b-mosaic_variants.json) they were faster than
  one at every shape timed, though they issue more instructions per weight (2.70 against 2.47, the fixed
  per-step cost spread over half the weights): K = N = 8192, M = 1: 15.7 us against 16.4; M = 8: 16.0
  against 16.5; M = 64: 22.9 against 23.4; grouped, 64 tokens, gate_up [1536, 2048]: 100.9 against 104.4,
  down [2048, 768]: 57.3 against 62.5 (and again in a second run, docs/gpu_check/h200-2026-12-04c-*).
  Not yet at block_m = 32 (TWO_WARPGROUPS_BLOCK_M). Their partial sums' scratch (block_m x 256 bytes)
  fits in what SMEM_BUDGET leaves of the block's shared memory.
  cluster 1: no x multicast. Measured on an H200 (docs/gpu_check/h200-2026-12-04-mosaic_variants.json),
  multicast to a cluster of block_m / 8 blocks made every call slower, though it cuts x's reads
  through L2 to under half the weight bytes: K = N = 8192, M = 1: 88.7 us against 62.5 us; M = 64
  (cluster 8): 274 us against 68 us; grouped gate_up, 64 tokens: 414 us against 186 us."""
  block_m = max(16, min(_next_power_of_2(m), 64))
  block_k = next((b for b in (512, 384, 256, SCALE_GROUP_K) if k % b == 0 and k // b >= 2), SCALE_GROUP_K)
  if block_k < 512 and _two_row_tiles_fit(k, n) and experts * (n // ROWS) // 2 >= WAVES * SMS:
    return step_tiles(block_m, 256, k, row_tiles=2)
  return step_tiles(block_m, block_k, k)


def with_row_tiles(tiles: MosaicTiles, row_tiles: int, k: int) -> MosaicTiles:
  """Steps of 512 / row_tiles of K on `row_tiles` 64-row tiles (step_tiles' slots and warpgroups), each block
  chaining the same 64-row tiles and pass lanes as `tiles` (a grouped block's rows kept): the other step shape of
  a grouped default, for side-by-side timing (mosaic_variants.py) and the compile report."""
  block_k, rows = 512 // row_tiles, tiles.tiles_per_block * tiles.row_tiles  # rows: a block's 64-row tiles
  if row_tiles not in (1, 2) or k % block_k or k // block_k < 2 or rows % row_tiles:
    raise ValueError(
      f"with_row_tiles: steps of {block_k} on {row_tiles} 64-row tiles need row_tiles 1 or 2, 2 steps or more of K = "
      f"{k}, and a block's {rows} tiles in whole steps."
    )
  s = step_tiles(tiles.block_m, block_k, k, row_tiles)
  return dataclasses.replace(s, tiles_per_block=rows // row_tiles, pass_lanes=tiles.pass_lanes)


def _two_row_tiles_fit(k: int, n: int) -> bool:
  """Whether steps of 256 on two 64-row tiles divide K in 2 steps or more and N in pairs of tiles."""
  return k % 256 == 0 and k // 256 >= 2 and n > 0 and (n // ROWS) % 2 == 0


def step_tiles(block_m: int, block_k: int, k: int, row_tiles: int = 1) -> MosaicTiles:
  """Tiles of steps of block_k on `row_tiles` 64-row tiles, with default_tiles' slots and compute warpgroups: as
  many slots (up to 4) as fit SMEM_BUDGET and divide the steps; two warpgroups where each takes whole 128-wide
  scale groups, at a block_m where two were timed faster (TWO_WARPGROUPS_BLOCK_M)."""
  step_bytes = block_m * block_k * 2 + row_tiles * block_k * ROWS * 9 // 16
  fit = SMEM_BUDGET // step_bytes
  slots = next(s for s in (4, 3, 2, 1) if s <= fit and (k // block_k) % s == 0)  # chained pipelines: s | steps
  compute_wgs = 2 if block_k % (2 * SCALE_GROUP_K) == 0 and block_m in TWO_WARPGROUPS_BLOCK_M else 1
  return MosaicTiles(block_m, block_k, slots, cluster=1, row_tiles=row_tiles, compute_wgs=compute_wgs)


# A block's fixed cost (launch, first copies, last MMAs and stores), in pipeline steps of 64 x 512 weights: dense,
# M = 8, N = 8192 on an H200 took 15.94 us at K = 8192 and 53.13 us at K = 32768, so 0.775 us a step and 3.54 us
# fixed (docs/gpu_check/h200-2026-12-04d-mosaic_variants.json).
BLOCK_FIXED_STEPS = 4.6


def default_grouped_tiles(m: int, num_experts: int, k: int, n: int = 0) -> MosaicTiles:
  """block_m: 16 while the mean group is at most 8 rows, else 32, so that at decode a group longer
  than block_m (which takes another pass, streaming its expert's tile again) is rare: at 256 tokens
  top-8 of 128 experts the groups are 16 +- 4 rows.
  tiles_per_block: the row units a block chains (its copies wait for HBM once, not once per unit), chosen
  by the time it predicts: rounds of SMS blocks x (BLOCK_FIXED_STEPS + the steps of a block's units), counting
  the blocks that stream (experts with rows: at most M; their second lanes only where passes are expected; the
  blocks that end at once are not counted, though on an H200 the empty second lanes cost 5-8 us: docs/gpu.md). At 64
  and 256 tokens top-8 of 128 experts that is one block per expert and lane, all its units chained. On an H200
  at 64 tokens (docs/gpu_check/h200-2026-12-04e-*, -04f-*): gate_up [1536, 2048] 87.8 us, against 101.0 at 4
  units per block (the earlier default; 750 blocks, 6 rounds) and 82.6 with one lane; down [2048, 768] 53.4
  us, against 56.5 and 45.6. One token's top-8 keeps 96 blocks (2 units each).
  pass_lanes: 2 where an expert's rows can take two passes (M > block_m: a group's rows from an 8-row boundary
  span start % 8 + size <= M rows), so that such an expert's second pass runs in a block of its own instead of
  doubling its block's time, and so the call's: 87.7 us against 155.7 with one lane (run f).
  row_tiles: where a step's x tile has more bytes than one 64-row tile's weights (block_m 32: x's reads through
  L2 would be 1.78x the weight bytes), 2 (steps of 256 on two 64-row tiles: the same weights per step, x read
  once per 128 rows) if K and N allow it and that model predicts no more time (at 256 tokens top-8 of 128 the
  same blocks, one per expert and lane), else default_tiles'. At 256 tokens, gate_up [1536, 2048]: x's L2 reads
  0.89x the weight bytes, 2.48 SASS instructions per weight (one tile at 512: 1.78x, 2.46; kernel_report.py), and
  the roofline, L2-bound with one tile, 2.7x bf16 against 1.9x: a model, untimed (neither form has been timed at
  256 tokens with its units chained). Not at block_m 16 (64 tokens), where x is 0.89x the weight bytes and run
  e timed two tiles (with 8 slots) 4.8% slower than one at the same rows per block: 90.7 us against 86.6
  (docs/gpu_check/h200-2026-12-04e-*); mosaic_variants.py times both forms (4 slots) at 64 and 256 tokens."""
  active = max(1, min(num_experts, m))  # experts with rows, at most (one for an empty x)
  block_m = 16 if m <= 8 * num_experts else 32
  tiles = default_tiles(block_m, k, n, active)
  lanes = 1 if m <= block_m else 2
  if not n:
    return dataclasses.replace(tiles, pass_lanes=lanes)
  expected_passes = max(1, math.ceil((m / active + 3.5) / block_m))  # a group starts 3.5 rows into its x tile
  lanes_used, lane_passes = min(lanes, expected_passes), -(-expected_passes // lanes)

  def predicted(tiles, t):  # in steps of 64 x 512 weights, for t row units per block
    units = n // ROWS // tiles.row_tiles
    blocks = active * lanes_used * units // t
    return -(-blocks // SMS) * (BLOCK_FIXED_STEPS + t * lane_passes * tiles.row_tiles * k / 512)

  def chained(tiles):  # its best units per block
    units = n // ROWS // tiles.row_tiles
    per_block = min(
      (t for t in range(1, units + 1) if units % (t * tiles.cluster) == 0), key=functools.partial(predicted, tiles)
    )
    return dataclasses.replace(tiles, tiles_per_block=per_block, pass_lanes=lanes)

  candidates = [chained(tiles)]
  if tiles.row_tiles == 1 and 2 * block_m > ROWS * 9 / 16 and _two_row_tiles_fit(k, n):  # x's bytes > the weights'
    candidates.append(chained(step_tiles(block_m, 256, k, row_tiles=2)))  # x read once per 128 rows: wins ties
  return min(candidates[::-1], key=lambda t: predicted(t, t.tiles_per_block))


def passes(group_sizes: np.ndarray, block_m: int) -> np.ndarray:
  """Per expert, the x tiles its rows touch in the grouped kernel (each streams the expert's weight
  tile): tiles start at multiples of 8 rows, so a group starting at row s with r rows takes
  ceil((s % 8 + r) / block_m), none when r = 0."""
  sizes = np.asarray(group_sizes)
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  return np.where(sizes > 0, -(-(starts % 8 + sizes) // block_m), 0)


def block_work(size_of, num_experts: int, expert, lane, block_m: int, lanes: int):
  """What a grouped block streams: (its expert's rows' start, its rows, the passes this block runs, pass(q)),
  pass(q) being the x tile of its q-th pass (block_m rows from the 8-row tile holding the group's start: a
  group takes ceil((start % 8 + size) / block_m) passes, `passes`); pass lane `lane` of `lanes` takes passes
  lane, lane + lanes, ... `size_of(g)`: expert g's rows. jnp scalar arithmetic: the kernel's prologue, which
  tests run on numbers. (Its unrolled loop over the experts runs in each of a block's 12 warps: about 370 SASS
  instructions at 128 experts, in every block's start, an empty lane's too.)"""
  start = jnp.int32(0)
  for g in range(num_experts):
    start = start + jnp.where(g < expert, size_of(g), 0)
  size = size_of(expert)
  passes = jnp.where(size > 0, (start % 8 + size + block_m - 1) // block_m, 0)
  count = jnp.maximum(passes - lane + lanes - 1, 0) // lanes
  return start, size, count, lambda q: lane + q * lanes


def block_may_work(size, num_experts: int, expert, lane, block_m: int):
  """False only for a grouped block with nothing to do (`MosaicTiles.early_exit`), from its expert's rows alone:
  a group of `size` rows starts at most 7 rows into its first x tile, so it takes at most ceil((7 + size) /
  block_m) passes, and lane `lane` has one only below that; lane 0 of the last expert also zero-fills the rows
  past the groups. (`block_work` says exactly what a block runs, after the sum over the experts before it.)"""
  return ((size > 0) & (lane * block_m < size + 7)) | ((expert == num_experts - 1) & (lane == 0))


def _next_power_of_2(n: int) -> int:
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.partial(jax.jit, static_argnames=("tiles", "out_dtype"))
def fp4_matmul_mosaic(
  x: jax.Array, w: FragmentWeight, *, tiles: MosaicTiles | None = None, out_dtype=jnp.bfloat16
) -> jax.Array:
  """x[M, K] (bf16) @ dequantize(w)^T -> [M, N] on an sm_90 GPU, M <= 64 (see the module
  docstring): the grouped kernel with one expert holding every row."""
  m, k = x.shape
  if len(w.shape) != 2 or k != w.shape[1]:
    raise ValueError(f"fp4_matmul_mosaic: x [M, {k}] does not match the weight {w.shape}.")
  tiles = tiles or default_tiles(m, k, w.shape[0])
  if m > tiles.block_m:
    raise NotImplementedError(f"fp4_matmul_mosaic: M = {m} above block_m = {tiles.block_m} (decode shapes only).")
  experts = FragmentWeight(w.words[None], None if w.tensor_scale is None else w.tensor_scale.reshape(1))
  return grouped_fp4_matmul_mosaic(x, jnp.full((1,), m, jnp.int32), experts, tiles=tiles, out_dtype=out_dtype)


@functools.partial(jax.jit, static_argnames=("tiles", "out_dtype"))
def grouped_fp4_matmul_mosaic(
  x: jax.Array, group_sizes: jax.Array, w: FragmentWeight, *, tiles: MosaicTiles | None = None, out_dtype=jnp.bfloat16
) -> jax.Array:
  """x [M, K] (rows sorted by expert, `group_sizes` [E] rows each) times expert e's weight^T for
  its rows -> [M, N], on an sm_90 GPU. Weights: `pack_fragments` of the experts [E, N, K].

  One block per (expert, pass lane, 64 x row_tiles x tiles_per_block weight rows): it reads the group sizes (its
  rows' start is the sum of the groups before it, unrolled: no metadata kernel), streams its expert's tiles once
  per x tile its rows touch (`passes`: once at decode; lane j of `tiles.pass_lanes` takes passes j, j + lanes,
  ...) and nothing for an expert without rows, and writes its rows itself (masked stores). Rows past
  sum(group_sizes) are zero (written by the last expert's lane-0 blocks), as in `grouped_fp4_matmul`; rows past
  M are never written."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  m, k = x.shape
  if w.words.ndim != 5:
    raise ValueError(f"grouped_fp4_matmul_mosaic: expected stacked experts [E, N, K], got a weight of shape {w.shape}.")
  num_experts, n, k_w = w.shape
  if k != k_w or group_sizes.shape != (num_experts,):
    raise ValueError(
      f"grouped_fp4_matmul_mosaic: x [M, {k}], group_sizes {group_sizes.shape} and experts {w.shape} do not match."
    )
  tiles = tiles or default_grouped_tiles(m, num_experts, k, n)
  if (n // ROWS) % (tiles.cluster * tiles.tiles_per_block * tiles.row_tiles):
    raise ValueError(
      f"grouped_fp4_matmul_mosaic: tiles.cluster x tiles.tiles_per_block x tiles.row_tiles = {tiles.cluster} x "
      f"{tiles.tiles_per_block} x {tiles.row_tiles} does not divide N / 64 = {n // ROWS}."
    )
  if tiles.overlap and (tiles.tiles_per_block > 1 or m > tiles.block_m or tiles.row_tiles > 1):
    raise ValueError(
      "grouped_fp4_matmul_mosaic: tiles.overlap needs one item per block (tiles_per_block = 1, row_tiles = 1, "
      f"M <= block_m; got {tiles}, M = {m}): Pallas' chained pipelines do not take delay_release."
    )
  if tiles.overlap and tiles.parts < 2:
    raise ValueError(
      f"grouped_fp4_matmul_mosaic: tiles.overlap with parts = {tiles.parts}: overlap needs parts >= 2. With one part "
      "a step's decode rewrites the registers that the previous step's MMAs, still in flight, read (undefined in "
      "PTX; on an H200 it gave wrong sums with two warpgroups and NaN at block_m = 64: "
      "docs/gpu_check/h200-2026-12-04b-gpu_check.json); with two or more the next step's first part writes "
      "registers whose MMAs are done (gpu_compile.inflight_register_writes). Use parts=2 or overlap=False."
    )
  if tiles.compute_wgs not in (1, 2) or tiles.block_k % (SCALE_GROUP_K * tiles.compute_wgs):
    raise ValueError(
      f"grouped_fp4_matmul_mosaic: tiles.compute_wgs = {tiles.compute_wgs} must be 1 or 2, each taking a multiple of "
      f"{SCALE_GROUP_K} of the block_k = {tiles.block_k} of a step."
    )
  if tiles.parts < 1 or (tiles.block_k // tiles.compute_wgs) % (SCALE_GROUP_K * tiles.parts):
    raise ValueError(
      f"grouped_fp4_matmul_mosaic: tiles.parts = {tiles.parts} must split a warpgroup's {tiles.block_k // tiles.compute_wgs} "
      f"of K per step into multiples of {SCALE_GROUP_K}."
    )
  if tiles.ping_pong not in ("", "issued", "done"):
    raise ValueError(f"grouped_fp4_matmul_mosaic: tiles.ping_pong = {tiles.ping_pong!r}: use 'issued', 'done' or ''.")
  if tiles.ping_pong and (tiles.compute_wgs != 2 or tiles.parts != 1 or tiles.overlap):
    raise ValueError(
      f"grouped_fp4_matmul_mosaic: tiles.ping_pong = {tiles.ping_pong!r} needs compute_wgs = 2, parts = 1 and "
      f"overlap off (got compute_wgs = {tiles.compute_wgs}, parts = {tiles.parts}, overlap = {tiles.overlap}): the two "
      "compute warpgroups take turns at the tensor cores."
    )
  if tiles.pass_lanes < 1:
    raise ValueError(f"grouped_fp4_matmul_mosaic: tiles.pass_lanes = {tiles.pass_lanes} must be 1 or more.")
  if tiles.block_m % 8 or not 8 <= tiles.block_m <= 64:
    raise ValueError(
      f"grouped_fp4_matmul_mosaic: tiles.block_m = {tiles.block_m} must be a multiple of 8 from 8 to 64."
    )
  chained = tiles.tiles_per_block > 1 or m > tiles.block_m  # a block may run several items, one pipeline each
  if chained and (k // tiles.block_k) % tiles.max_concurrent_steps:
    raise ValueError(
      f"grouped_fp4_matmul_mosaic: tiles.max_concurrent_steps = {tiles.max_concurrent_steps} must divide the "
      f"{k // tiles.block_k} steps of K when a block chains items (tiles_per_block > 1 or M > block_m)."
    )
  if k % tiles.block_k:
    raise ValueError(
      f"grouped_fp4_matmul_mosaic: tiles.block_k = {tiles.block_k} does not divide K = {k}: the steps would leave "
      f"{k % tiles.block_k} of K out (take a block_k that divides it, or default_grouped_tiles')."
    )
  block_m, block_k = tiles.block_m, tiles.block_k
  x = x.astype(jnp.bfloat16)
  if m > 8 and m % 8:  # x's copies are tiled 8 rows deep: 8 rows or fewer, or a multiple of 8
    x = jnp.pad(x, ((0, -m % 8), (0, 0)))
  x_swizzle = plgpu.find_swizzle(block_k * 16, "rhs")
  x_transforms = (plgpu.TilingTransform((8, x_swizzle // 2)), plgpu.SwizzleTransform(x_swizzle))
  row_tiles = tiles.row_tiles
  compute_wgs = tiles.compute_wgs
  assert _registers_fit(compute_wgs), MEMORY_REGISTERS  # else a consumer's setmaxnreg.inc never returns
  parts = tiles.parts
  wg_k = block_k // compute_wgs  # a compute warpgroup's share of a step's K
  part_k = wg_k // parts
  wg_groups = wg_k // SCALE_GROUP_K if compute_wgs > 1 else 0
  # decode[p][t]: part p of row tile t (a warpgroup's K groups p * part_k / 128 on, past its own first one)
  decode = [
    [_decode_tile(part_k, t, p * part_k // SCALE_GROUP_K, wg_groups) for t in range(row_tiles)] for p in range(parts)
  ]
  store_rows = _store_rows(block_m, out_dtype)
  sum_warpgroups = _sum_warpgroups(block_m, compute_wgs) if compute_wgs > 1 else None
  turn = {kind: _turn(kind) for kind in ("wait", "end", "start", "finish")} if tiles.ping_pong else None

  per_block = tiles.tiles_per_block
  lanes = tiles.pass_lanes
  steps = k // block_k

  has_scale = w.tensor_scale is not None  # else no scale operand: XLA would make a kernel of the ones

  def kernel(*refs):
    if not tiles.early_exit:
      return work(*refs)
    expert, lane, sizes_gmem = jax.lax.axis_index("e"), jax.lax.axis_index("p"), refs[1]
    pl.when(block_may_work(sizes_gmem[expert], num_experts, expert, lane, block_m))(lambda: work(*refs))

  def work(x_gmem, sizes_gmem, words_gmem, *scale_and_out):
    *scale_gmem, out_gmem = scale_and_out
    expert, tile0 = jax.lax.axis_index("e"), jax.lax.axis_index("n") * per_block
    lane = jax.lax.axis_index("p")
    start, size, passes, pass_of = block_work(lambda g: sizes_gmem[g], num_experts, expert, lane, block_m, lanes)
    scale = scale_gmem[0][expert] if has_scale else jnp.float32(1.0)

    total = start + size  # for the last expert: every grouped row

    @pl.when((expert == num_experts - 1) & (lane == 0) & (jax.lax.axis_index("wg") == 0))  # the compute warpgroup
    def _():
      zeros = plgpu.layout_cast(jnp.zeros((ROWS, block_m), jnp.float32), plgpu.Layout.WGMMA)

      @pl.loop(0, (m - total + block_m - 1) // block_m)
      def _(tile):
        row0 = total + tile * block_m
        for t in range(per_block * row_tiles):
          store_rows(zeros, row0, 0, jnp.minimum(m - row0, block_m), (tile0 * row_tiles + t) * ROWS, scale, out_gmem)

    def body(_, x_smem, words_smem, accs):
      if compute_wgs > 1:  # this warpgroup's share of K (its words: _decode_tile)
        x_smem = x_smem.at[:, pl.ds(pl.multiple_of(jax.lax.axis_index("wg") * wg_k, wg_k), wg_k)]
      if tiles.ping_pong:  # decode; multiply after the other warpgroup's turn; end this one's turn
        registers = [decode_tile(words_smem) for decode_tile in decode[0]]
        turn["wait"]()  # (ptxas moves part of the decode past this wait: "issued" lets it overlap the other's MMAs)
        for a, acc_ref in zip(registers, accs):
          plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(x_smem, (1, 0)))
        if tiles.ping_pong == "issued":
          turn["end"]()
        plgpu.wgmma_wait(0)
        if tiles.ping_pong == "done":
          turn["end"]()
        return accs
      if parts == 1:
        for decode_tile, acc_ref in zip(decode[0], accs):  # one x tile for the unit's row tiles
          plgpu.wgmma(acc_ref, decode_tile(words_smem), plgpu.transpose_ref(x_smem, (1, 0)))
          plgpu.wgmma_wait(0)  # the decoded registers are free again (overlap needs parts > 1: they would not be)
        return accs
      for p in range(parts):  # part p + 1 decodes while part p's MMAs run: at most two wgmma groups in flight
        x_part = plgpu.transpose_ref(x_smem.at[:, p * part_k : (p + 1) * part_k], (1, 0))
        for decode_tile, acc_ref in zip(decode[p], accs):
          plgpu.wgmma(acc_ref, decode_tile(words_smem), x_part)
          plgpu.wgmma_wait(1)  # the group before this one is done: its registers are free for the next decode
      if not tiles.overlap:  # (with overlap the last part's group stays in flight into the next step)
        plgpu.wgmma_wait(0)
      return accs

    def pipeline(compute_context, row0, unit, state):
      return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(steps,),
        memory_registers=MEMORY_REGISTERS[compute_wgs],
        in_specs=[
          plgpu.BlockSpec(
            (pl.Element(block_m), block_k),
            lambda kk: (row0, kk),
            transforms=x_transforms,
            collective_axes=("cn",) if tiles.cluster > 1 else (),
            delay_release=int(tiles.overlap),
          ),
          plgpu.BlockSpec(
            (row_tiles, block_k // SCALE_GROUP_K, 9, THREADS),
            lambda kk: (unit, kk, 0, 0),
            delay_release=int(tiles.overlap),
          ),
        ],
        wg_axis="wg",
        num_compute_wgs=compute_wgs,
        max_concurrent_steps=tiles.max_concurrent_steps,
        compute_context=compute_context,
        pipeline_state=state,
      )

    # x's tiles start at a multiple of 8 rows (its copies are tiled 8 rows deep): the group's rows
    # are [start - base, start - base + size) of the tiles from `base` on.
    base = start // 8 * 8

    # One pipeline per (pass, weight tile), chained (START, STEADY..., STOP): the producer fetches the
    # next one's first steps while the consumer finishes this one, so a block pays the copies'
    # latency once, not per tile. A lone item runs unchained (state None): its producer waits for the
    # consumers before it ends (with a cluster, the other blocks' consumers arrive on this block's
    # barriers: it must not exit first), as STOP does at the end of a chain.
    items = passes * per_block  # this block's passes x its row units

    def where(item):  # (first x row, row unit) of an item: the units of one pass, then the next pass
      return base + pass_of(item // per_block) * block_m, tile0 + item % per_block

    def run(item, state, allocations, scratch):
      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, accs=[plgpu.ACC((ROWS, block_m), jnp.float32)] * row_tiles)
        def _(accs):
          if tiles.ping_pong:
            turn["start"]()
          eval_pipeline(accs)
          if tiles.ping_pong:
            turn["finish"]()
          if tiles.overlap:
            plgpu.wgmma_wait(0)
          row0, unit = where(item)  # after the loop: fewer values live through it
          lo = jnp.maximum(start - row0, 0)
          hi = jnp.minimum(jnp.minimum(start + size, m) - row0, block_m)
          sums = [acc_ref[...] for acc_ref in accs]
          if compute_wgs > 1:  # the warpgroups' partial sums, added in warpgroup 0
            sums = [sum_warpgroups(acc, scratch) for acc in sums]

          @pl.when(jax.lax.axis_index("wg") == 0)
          def _():
            for t, acc in enumerate(sums):
              store_rows(acc, row0, lo, hi, (unit * row_tiles + t) * ROWS, scale, out_gmem)

      row0, unit = where(item)
      pipeline(compute_context, row0, unit, state)(x_gmem, words_gmem.at[expert], allocations=allocations)

    ignore = lambda *_, **__: None
    allocations = pipeline(ignore, 0, 0, None).get_allocations(x_gmem, words_gmem.at[expert])

    # compute_wgs > 1: where the warpgroups' partial sums meet (block_m / 4 f32 pairs per thread)
    scratch = dict(scratch=plgpu.SMEM((block_m // 4, THREADS, 2), jnp.float32)) if compute_wgs > 1 else {}

    @functools.partial(pl.run_scoped, allocations=allocations, **scratch, collective_axes="wg")
    def _(allocations, scratch=None):
      @pl.when(items == 1)
      def _():
        run(0, None, allocations, scratch)

      if chained:  # else a block has at most one item

        @pl.when(items > 1)
        def _():
          @pl.loop(0, items)
          def _(item):
            state = jnp.where(item == 0, int(plgpu.PipelinePipeline.START), int(plgpu.PipelinePipeline.STEADY))
            state = jnp.where(item == items - 1, int(plgpu.PipelinePipeline.STOP), state)
            run(item, state, allocations, scratch)

  scale = [jnp.broadcast_to(w.tensor_scale.reshape(-1), (num_experts,)).astype(jnp.float32)] if has_scale else []
  return plgpu.kernel(
    kernel,
    out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
    grid=(num_experts, lanes, n // ROWS // row_tiles // per_block),
    grid_names=("e", "p", "n"),
    **(dict(cluster=(1, 1, tiles.cluster), cluster_names=("ce", "cp", "cn")) if tiles.cluster > 1 else {}),
    num_threads=compute_wgs + 1,
    thread_name="wg",
    compiler_params=plgpu.CompilerParams(),  # lane semantics: scalar control flow in the kernel
  )(x, group_sizes.astype(jnp.int32), w.words, *scale)
