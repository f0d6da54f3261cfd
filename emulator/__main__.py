"""`python -m emulator [FLAGS]`: run the SGLang emulator (same command as `tokenmill emulator`).

See `python -m emulator --help` for the flags and their environment variables.
"""

from emulator.cli import emulator

emulator(prog_name="python -m emulator")
