python3 scripts/gpu/qlinear_probe.py
