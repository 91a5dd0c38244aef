"""How a sliced init graph runs. ``eager``: an fx interpreter with exact RNG replay."""
