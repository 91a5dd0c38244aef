"""The InitGraph of a traced module: its deferred tensors' slice of the trace, self-contained.

``init_graph(module)`` copies the nodes the module's still-deferred parameters and buffers
(under the keys of its ``state_dict()``, then its non-persistent buffers: ``fxinit.entries``)
need out of the trace's graph (with the constants and generator snapshots they read, the
names storages had when the trace ended, and the transformers config it was built from), so
the result materializes, saves and exports without the model or its code.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx

from fxinit.capture.deferred import is_deferred_tensor, state_of
from fxinit.capture.materialized_marks import trace_serial
from fxinit.capture.provenance import Provenance
from fxinit.entries import Entry, model_entries
from fxinit.errors import DeferredInitError
from fxinit.execute import slicer
from fxinit.graph import InitGraph
from fxinit.reachable import left_behind, module_walk
from fxinit.spec import OutputInfo, TensorSpec


def init_graph(module: torch.nn.Module, carry_real: bool = True, entries: list[Entry] | None = None) -> InitGraph:
    """The InitGraph of ``module``'s deferred parameters and buffers, by fully qualified name.

    With ``carry_real`` (default), the real tensors the model holds that fxinit did not
    materialize (``torch.load`` or numpy data kept as it is, a buffer computed by an init
    step after the trace) are outputs too, as constants: the graph is the whole model.
    ``entries``: those of ``model_entries`` when the caller has them (a state-dict hook runs once)."""
    named: dict[str, torch.Tensor] = {}
    info: dict[str, OutputInfo] = {}
    real: dict[str, torch.Tensor] = {}
    if entries is None:
        entries = model_entries(module, non_persistent=True)
    traced = {state_of(e.tensor).recorder.serial for e in entries if is_deferred_tensor(e.tensor)}
    for e in entries:
        fqn, t = e.key, e.tensor
        if fqn in named or fqn in real:
            continue
        # (real: not what this trace materialized; a module materialized by another trace is data here)
        if is_deferred_tensor(t) or (carry_real and t.device.type != "meta"
                                     and trace_serial(t) not in traced and not hasattr(t, "_local_tensor")):
            (named if is_deferred_tensor(t) else real)[fqn] = t
            info[fqn] = OutputInfo(requires_grad=t.requires_grad, is_parameter=e.is_parameter,
                                   persistent=e.persistent)
    if not named:
        raise ValueError("this module has no deferred tensors (was it built with fxinit.trace_init?)")
    wrapped = [f"{path}.{name}" if path else name for path, _, kind, name, t in module_walk(module)
               if kind == "inner" and is_deferred_tensor(t)]
    if wrapped:
        raise DeferredInitError(
            f"{len(wrapped)} deferred tensor(s) of this model are inside wrapper tensor subclasses "
            f"({', '.join(wrapped[:3])}{' ...' if len(wrapped) > 3 else ''}): an init graph names plain tensors, "
            "and only the subclass's own code can build the object around them",
            hint="materialize the model (fxinit.materialize), or take the init graph before the step that wraps them "
                 "(quantization)")
    left = left_behind(module)
    if left:
        raise DeferredInitError(
            f"{len(left)} tensor(s) of this model are plain meta tensors fxinit did not record: {', '.join(left[:6])}",
            hint="see fxinit.materialize's error for the same model: build them on a real device, or record the "
                 "step that makes them inside `with fxinit.recording(model):`")
    recorders = {id(state_of(t).recorder): state_of(t).recorder for t in named.values()}
    if len(recorders) != 1:
        raise DeferredInitError("this module's tensors come from several traces; take init_graph of each part")
    rec = next(iter(recorders.values()))
    rec._check_live()
    targets = {fqn: (state_of(t).node, rec.storage_id(t)) for fqn, t in named.items()}
    nodes = slicer(rec, eliminate_dead=False).required(targets.values())[0]
    paths = rec.module_paths()
    graph = fx.Graph()
    remap: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        new = graph.node_copy(n, lambda x: remap[x])
        ref = new.meta.pop("module_ref", None)
        mod = ref() if ref is not None else None
        if "module" not in new.meta and mod is not None and id(mod) in paths:
            new.meta["module"] = paths[id(mod)]
        remap[n] = new
    outputs = {fqn: remap[node] for fqn, (node, _) in targets.items()}
    constants = {k: v for k, v in rec.constants.items() if k in used_consts(nodes)}
    storage = {fqn: targets[fqn][1] for fqn in targets}
    add_real_outputs(graph, real, outputs, storage, constants)
    graph.output({fqn: node for fqn, node in outputs.items()})
    groups: dict[int, list[str]] = defaultdict(list)
    for fqn, t in named.items():
        groups[id(t)].append(fqn)
    for e in entries:
        if is_deferred_tensor(e.tensor) and e.key not in groups[id(e.tensor)]:
            groups[id(e.tensor)].append(e.key)
    ties = [g for g in groups.values() if len(g) > 1]
    for g in ties:
        for fqn in g:
            outputs.setdefault(fqn, outputs[g[0]])
            info.setdefault(fqn, info[g[0]])
    for g in ties:
        for fqn in g:
            storage.setdefault(fqn, targets[g[0]][1])
    used_storages = {sid for n in nodes for sid in (*n.meta.get("reads", ()), *n.meta.get("mutates", ()))}
    used_snapshots = {k for n in nodes for k in (n.meta.get("generators") or {}).values()}
    return InitGraph(
        graph=graph,
        outputs=outputs,
        output_storage=storage,
        info=info,
        ties=ties,
        constants=constants,
        snapshots={k: v for k, v in rec.snapshots.items() if k in used_snapshots},
        default_dtype=rec.default_dtype,
        numerics=rec.numerics,
        seed=rec.seed,
        stream_names={sid: name for sid, name in rec.storage_names().items() if sid in used_storages},
        hf_config=hf_config(module),
    )


def used_consts(nodes: list[fx.Node]) -> set[str]:
    return {n.target for n in nodes if n.op == "get_attr"}


def add_real_outputs(graph: fx.Graph, real: dict[str, torch.Tensor], outputs: dict[str, fx.Node],
                     storage: dict[str, int], constants: dict[str, torch.Tensor]) -> None:
    """Real tensors the model holds that fxinit did not materialize (``torch.load`` or numpy
    data kept as it is, a buffer an init step computed after the trace) go into the graph as
    constants, a copy of their value now: the file is the whole model, not its deferred part."""
    by_object: dict[int, tuple[fx.Node, int]] = {}
    last = max((n.meta.get("pos", 0) for n in graph.nodes), default=0)
    sids = [sid for n in graph.nodes for sid in (*n.meta.get("reads", ()), *n.meta.get("mutates", ()))]
    free_sid = max([*sids, *storage.values(), 0]) + 1  # storage ids no recorded node uses
    for fqn, t in real.items():
        if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
            raise DeferredInitError(
                f"{fqn} is an uninitialized parameter of a lazy module: it has no shape yet to write into an init "
                "graph", op="init_graph",
                hint="run fxinit.dry_run(model, example_input) first, which records the forward that gives it one")
        if t.layout != torch.strided:
            raise DeferredInitError(
                f"{fqn} is a {t.layout} tensor: an init graph holds strided tensors only, and this model's "
                f"{fqn} cannot be written into one", op="init_graph",
                hint="materialize and save the model itself (torch.save, save_pretrained), or drop or make dense "
                     "that tensor before init_graph; fxinit.materialize gives it as eager's")
        if id(t) not in by_object:
            i = len(by_object)
            name = f"_real{i}"
            constants[name] = t.detach().clone(memory_format=torch.preserve_format)
            node = graph.get_attr(name)
            node.meta.update(reads=(), mutates=(), spec=TensorSpec.of(t, t.device), pos=last + 1 + i,
                             prov=Provenance(f"<a real tensor the model holds: {fqn}>", None, None))
            by_object[id(t)] = (node, free_sid + i)
        outputs[fqn], storage[fqn] = by_object[id(t)]


def hf_config(module: torch.nn.Module) -> dict[str, Any] | None:
    """``module.config`` as ``config.json`` would hold it, when the module is a transformers
    model (``architectures`` filled as ``save_pretrained`` fills it)."""
    config = getattr(module, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if to_json is None or not hasattr(config, "model_type"):
        return None
    import json

    data = json.loads(to_json(use_diff=False))
    data["architectures"] = data.get("architectures") or [type(module).__name__]
    return data
