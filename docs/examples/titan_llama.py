"""A torchtitan-style Llama, initialized the torchtitan way, with fxinit and without.

torchtitan builds its model on the meta device, parallelizes it (tensor parallel, FSDP2),
allocates it with ``to_empty`` and initializes it with ``init_weights``: ``trunc_normal_``
with a depth-scaled std, and a RoPE table recomputed on a buffer device. The one change
fxinit asks for is the first line of ``build``: ``fxinit.trace_init`` instead of plain meta
construction; ``fxinit.materialize`` then fills every rank's shards, each bit for bit the
matching slice of the same flow run on one process, whatever the layout.

    torchrun --nproc-per-node 4 docs/examples/titan_llama.py            # 2 x 2 mesh: TP inside FSDP2
    torchrun --nproc-per-node 2 docs/examples/titan_llama.py --tp 2     # tensor parallel only

Each rank checks its tensors against the single-process flow and prints what it found.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxinit


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 101  # not a multiple of the TP degree: uneven shards
    hidden_dim: int = 160
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 32
    depth_init: bool = True
    tie_embeddings: bool = False


def precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    return torch.polar(torch.ones(end, dim // 2, device=freqs.device), torch.outer(t, freqs).float())


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, x_.shape[-1])
    return torch.view_as_real(x_ * freqs).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.n_rep = args.n_heads // args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = apply_rotary_emb(self.wq(x).view(bs, seqlen, -1, self.head_dim), freqs_cis)
        k = apply_rotary_emb(self.wk(x).view(bs, seqlen, -1, self.head_dim), freqs_cis)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        k, v = (t.repeat_interleave(self.n_rep, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def _precompute_freqs_cis(self) -> torch.Tensor:
        return precompute_freqs_cis(self.args.dim // self.args.n_heads, self.args.max_seq_len * 2,
                                    self.args.rope_theta)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = self._precompute_freqs_cis()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        final_out_std = self.args.dim ** -0.5
        if not self.args.tie_embeddings:
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=final_out_std, a=-3 * final_out_std,
                                  b=3 * final_out_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def parallelize(model: Transformer, tp_mesh=None, dp_mesh=None) -> Transformer:  # noqa: ANN001
    """torchtitan's layout: tensor (and sequence) parallel inside, FSDP2 (or HSDP) outside."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    if tp_mesh is not None:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=False),
        })
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInputOutput(input_layouts=(Shard(1), None),
                                                      desired_input_layouts=(Replicate(), None),
                                                      output_layouts=Shard(1), desired_output_layouts=Shard(1)),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            })
    if dp_mesh is not None:
        for block in model.layers.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def build(args: ModelArgs, tp_mesh=None, dp_mesh=None, use_fxinit: bool = True) -> Transformer:  # noqa: ANN001
    """torchtitan's flow; with ``use_fxinit`` the meta construction is traced instead."""
    with torch.device("meta"):
        model = fxinit.trace_init(Transformer, args) if use_fxinit else Transformer(args)
    parallelize(model, tp_mesh, dp_mesh)
    model.to_empty(device="cpu")
    if args.tie_embeddings:  # after parallelizing, as torchtitan does, and after to_empty, which unties plain tensors
        model.output.weight = model.tok_embeddings.weight
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # as torchtitan's trainer calls it: the buffers' own device
    if use_fxinit:
        fxinit.materialize(model)
    return model


def single_process_reference(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """The same flow on one process, without parallelism: what every rank's shards must equal."""
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in build(args, use_fxinit=False).state_dict().items()}


def main() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (the rest is FSDP2)")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // opts.tp
    mesh = init_device_mesh("cpu", (dp, opts.tp), mesh_dim_names=("dp", "tp"))
    args = ModelArgs()
    want = single_process_reference(args, opts.seed)
    torch.manual_seed(opts.seed)
    model = build(args, mesh["tp"] if opts.tp > 1 else None, mesh["dp"] if dp > 1 else None)
    wrong = []
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            expected = distribute_tensor(want[name], t.device_mesh, t.placements, src_data_rank=None).to_local()
            if not torch.equal(t.to_local(), expected):
                wrong.append(name)
        elif not torch.equal(t, want[name]):
            wrong.append(name)
    logits = model(torch.randint(0, args.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1)))
    print(f"rank {rank}: {len(model.state_dict()) - len(wrong)}/{len(model.state_dict())} tensors equal to the "
          f"single-process flow {'' if not wrong else wrong}; forward ok: {bool(torch.isfinite(logits.full_tensor() if isinstance(logits, DTensor) else logits).all())}",
          flush=True)
    dist.destroy_process_group()
    if wrong:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
