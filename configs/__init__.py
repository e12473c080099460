"""Named configs as typed Python functions (no YAML): model shapes in `models.py`."""
