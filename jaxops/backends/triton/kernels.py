"""The Triton backend's entry points, as the registry hands them out (`contract.py`:
`forward_stats`, `backward_logits`; `can_write_into` for the in-place gradient)."""

from jaxops.backends.triton.backward import backward_logits, can_write_into
from jaxops.backends.triton.config import PallasConfig
from jaxops.backends.triton.forward import forward_stats

__all__ = ["PallasConfig", "backward_logits", "can_write_into", "forward_stats"]
