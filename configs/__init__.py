"""`get_config()` files for ml_collections: `--config=configs/<file>.py:<arg>`; `models` holds the model presets."""
