"""Programs that tools/device_check.py starts: under torchrun (ddp_check, tp_check) or alone and under
compute-sanitizer (sanitize_cases). Not entry points of their own."""
