"""Checkpoints of freshly initialized models, written in bounded memory (``fxinit.save``).

    source.py              what is exported: names, shapes, ties, and how to compute any piece
    plan.py                which tensors go to which file; which files a part writes
    produce.py             computing pieces ahead of the writer, bytes in flight bounded
    safetensors_format.py  the safetensors header, for writing a file tensor by tensor
    files.py               files complete under their final name or absent; disk errors in words
    resume.py              the plan record and per-file checksums that ``resume`` verifies
    progress.py            bytes, rate and time left
    run.py                 one export's options and what the formats share
    hf.py                  the Hugging Face layout (shards, index, config.json)
    dcp.py                 torch.distributed.checkpoint, through its planner and storage writer
    save.py                ``fxinit.save``
"""

from fxinit.export.run import Exported
from fxinit.export.save import save

__all__ = ["Exported", "save"]
