"""Environment switches, read one way everywhere (the library's build options, tools/device_check.py's defaults).
Pure Python: it imports nothing that builds."""

import os


def env_flag(name):
    """Whether the switch `name` is on: its variable set to anything but "" or "0"."""
    return os.environ.get(name, "") not in ("", "0")
