"""Tools for people who test an attention impl against the flash-layers contract.

`reference64` is the float64 NumPy oracle the conformance suite checks every impl
against, forward and backward (a hand-derived backward, no autodiff, nothing
imported from flash_layers). Use it to test an impl of your own:

    from flash_layers.testing import reference64
    visible = reference64.mask(b, t, s, causal=True)[:, None]
    expected = reference64.attention(q, k, v, visible, dout=dout)
"""

from flash_layers.testing import reference64

__all__ = ["reference64"]
