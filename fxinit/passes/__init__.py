"""Passes over init graphs: slicing to requested outputs (more to come: dead-init elimination, fusion)."""

from fxinit.passes.slicing import required_nodes

__all__ = ["required_nodes"]
