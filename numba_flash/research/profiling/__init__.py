"""Instruments: FLOP and byte counts, GPU timing, and kernel resource use."""
