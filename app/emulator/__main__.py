"""`python -m app.emulator [FLAGS]`: run the SGLang emulator (same command as `tokenmill emulator`).

See `python -m app.emulator --help` for the flags and their environment variables.
"""

from app.emulator.cli import emulator

emulator(prog_name="python -m app.emulator")
