"""Passes over init graphs: slicing to requested outputs, dead-init elimination, and the
partition of a slice into independent groups for parallel execution."""

from fxinit.passes.dead_init import dead_writes
from fxinit.passes.partition import independent_groups
from fxinit.passes.slicing import required_nodes

__all__ = ["dead_writes", "independent_groups", "required_nodes"]
