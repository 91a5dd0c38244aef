"""Generator snapshots and replay: what makes materialization exact and order-free."""

from fxinit.rng.snapshot import (PendingSnapshot, RngSnapshot, Snapshot, default_generator_for, private_generator,
                                 snapshot, swapped_default_generators)

__all__ = ["PendingSnapshot", "RngSnapshot", "Snapshot", "default_generator_for", "private_generator", "snapshot",
           "swapped_default_generators"]
