"""Helpers shared by the test layers: SGLang's published JSON contract and a running emulator.

Nothing here is imported by the application; tests import it as `tests.support...`.
"""
