"""The `tokenmill emulator` command: runs the SGLang emulator (defined in emulator.cli).

Re-exported here so the operator CLI group can register it beside the other commands.
"""

from emulator.cli import emulator

__all__ = ["emulator"]
