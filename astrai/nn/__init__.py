"""Pure layers: one file per layer, each with an `XxxParams` tree, `init_xxx()` and an apply function."""
