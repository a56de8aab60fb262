"""The performance model (paper §4.4, Eq. 1) and what feeds it: a model's description from its
checkpoint, hardware and network presets, expected experts per node under a placement, and
calibration from measured runs; `command.py` is `moe-cluster plan`."""
