"""The Mosaic GPU backend's entry points, as the registry hands them out (`contract.py`:
`forward_stats`, `backward_logits`; `can_write_into` for the in-place gradient)."""

from jaxops.backends.mosaic.backward import backward_logits, can_write_into
from jaxops.backends.mosaic.common import STORES_INTO_INPUTS
from jaxops.backends.mosaic.forward import forward_stats

__all__ = ["STORES_INTO_INPUTS", "backward_logits", "can_write_into", "forward_stats"]
