"""Compute kernels: Triton implementations and their plain-torch reference twins.

`pagedbatch_kernels.reference` holds the plain-torch versions; they run on any device and are
the ground truth that every Triton kernel is tested against.
"""
