"""The layering of trace_jax: imports go one way (down the data flow), never in a circle.

Read from the source with `ast` (nothing is imported), so a call-time import counts too.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "trace_jax"


def _imports() -> dict[str, set[str]]:
  """module -> the trace_jax modules it imports (anywhere in the file), e.g. 'rollout' -> {'fp4', ...}."""
  modules = {p.stem: p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
  modules["data"] = PACKAGE / "data" / "__init__.py"
  graph = {}
  for name, path in modules.items():
    files = list((PACKAGE / "data").glob("*.py")) if name == "data" else [path]
    deps = set()
    for f in files:
      for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trace_jax"):
          parts = node.module.split(".")
          if len(parts) > 1:
            deps.add(parts[1])
          else:  # from trace_jax import a, b
            deps.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
          deps.update(a.name.split(".")[1] for a in node.names if a.name.startswith("trace_jax."))
    graph[name] = deps & set(modules) - {name}
  return graph


def test_sharding_imports_nothing_from_the_model_or_the_engine():
  assert not _imports()["sharding"] & {"model", "moe", "attention", "rollout", "train", "trainer", "cluster"}


@pytest.mark.parametrize("module", ["config", "fp4", "quantizer", "data"])
def test_foundations_import_no_model_code(module):
  assert _imports()[module] <= {"config", "fp4", "quantizer", "data"}, _imports()[module]


# The module map of the README, bottom layer first: each module imports only modules before it.
LAYERS = (
  "fp4",
  "quantizer",
  "config",
  "data",
  "sharding",
  "qat",
  "expert_parallel",
  "attention",
  "deltanet",
  "moe",
  "model",
  "experience",
  "rollout",
  "rl",
  "cluster",
  "trainer",
  "checkpoint",
  "metrics_writer",
  "console",
  "job",
  "hf",
  "async_rl",
  "export",
  "train",
  "evaluate",
  "main",
)


def test_modules_import_only_the_layers_below():
  graph = _imports()
  assert set(LAYERS) == set(graph), "add the new module to LAYERS and to the README's module map"
  for i, module in enumerate(LAYERS):
    above = graph[module] - set(LAYERS[:i])
    assert not above, f"{module} imports {sorted(above)}, which come after it in the layering"


def test_no_import_cycles():
  graph = _imports()
  state: dict[str, str] = {}

  def visit(node, path):
    state[node] = "open"
    for dep in sorted(graph[node]):
      assert state.get(dep) != "open", f"import cycle: {' -> '.join([*path, node, dep])}"
      if dep not in state:
        visit(dep, [*path, node])
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node, [])
