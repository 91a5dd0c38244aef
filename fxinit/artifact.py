"""The saved form of an InitGraph: versioned, checksummed, and safe to load.

A file is a torch.save archive of one plain dict (str, int, float, bool, None, lists, dicts
and tensors only) with a checksum record of its own (``fxinit.archive``; documented for
users in docs/artifact-format.md), so ``torch.load(path, weights_only=True)`` reads it
without fxinit.

Loading never runs pickled code: the checksum is verified first, the payload is read
with ``torch.load(weights_only=True)``, every field is type-checked, every op must be an
allowed aten overload, ``operator.getitem`` or an allowed opaque init function, and the
whole graph is re-run on the meta device to check that the shapes it declares are the
shapes it computes. Anything else raises ``ArtifactError``.
"""

from __future__ import annotations

import inspect
import operator
import os
import re
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
import torch.fx as fx

from fxinit.archive import pack, short_message, unpack
from fxinit.capture.provenance import Provenance
from fxinit.capture.random_draws import META_RESULTS
from fxinit.errors import ArtifactError
from fxinit.init_bodies import body_fingerprint
from fxinit.numerics import SETTINGS, Numerics, check_value
from fxinit.ops import OPAQUE_INIT_FUNCTIONS, call_init_function, draws_random, replay_args, resolve_init_function
from fxinit.rng import RngSnapshot, Snapshot
from fxinit.rng.kernel_fingerprints import fingerprint
from fxinit.rng.philox import PENDING_FIELDS, PendingPhilox, decode_pending, encode_pending
from fxinit.spec import OutputInfo, TensorSpec

if TYPE_CHECKING:  # annotations only: graph.py imports this module
    from fxinit.graph import InitGraph

FORMAT = "fxinit-init-graph"
SCHEMA_VERSION = 7  # 7: torch's numeric settings ("numerics"); 6: fingerprints of the CPU random kernels ("random_kernels"); 5: nodes of ops eager runs otherwise ("inexact"); 4: opaque nodes' body fingerprints; 3: CUDA snapshots pending their device (rng.philox); 2: hf_config;
# 1: the payload of the older header layout, still read
MAX_NODES = 10_000_000
MAX_CONFIG_DEPTH = 32
MAX_CONFIG_ITEMS = 1_000_000

# aten ops that touch anything but tensors (files) are never allowed in a saved graph.
_DENIED_ATEN = {"from_file"}
_ATEN_NAME = re.compile(r"aten\.([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)$")
_GETITEM = "operator.getitem"
_OPAQUE = "fxinit.ops.call_init_function"
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64)}
_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format,
                   "channels_last": torch.channels_last, "channels_last_3d": torch.channels_last_3d}
_CPU_STATE_BYTES = 5056


# ---------------------------------------------------------------------------- save
def save_graph(graph: InitGraph, path: str | os.PathLike) -> None:
    """Write ``graph`` to ``path`` (see the module doc for the layout)."""
    names = {n: n.name for n in graph.nodes}
    payload = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "torch_version": str(torch.__version__),
        "default_dtype": _dtype_name(graph.default_dtype),
        "seed": graph.seed,
        "stream_names": {int(k): v for k, v in graph.stream_names.items()},
        "nodes": [_encode_node(n, names) for n in graph.nodes],
        "outputs": {fqn: names[node] for fqn, node in graph.outputs.items()},
        "output_storage": dict(graph.output_storage),
        "info": {fqn: [i.requires_grad, i.is_parameter, i.persistent] for fqn, i in graph.info.items()},
        "ties": [list(g) for g in graph.ties],
        "constants": {k: v.detach().cpu().contiguous() if v.device.type != "cpu" else v.detach()
                      for k, v in graph.constants.items()},
        "rng": {**{k: {"device": s.device, "state": s.state.cpu()} for k, s in graph.snapshots.items()
                    if not isinstance(s, PendingPhilox)}, **encode_pending(graph.snapshots)},
        "hf_config": _checked_config(graph.hf_config, "cannot save this graph"),
        "random_kernels": _random_kernels(graph.nodes),
        "numerics": _encode_numerics(graph.numerics),
    }
    data = pack(payload)
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _target_name(n: fx.Node) -> str:
    if n.op == "get_attr":
        return str(n.target)
    if n.target is operator.getitem:
        return _GETITEM
    if n.target is call_init_function:
        return _OPAQUE
    if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "aten":
        return f"aten.{n.target._opname}.{n.target._overloadname}"
    raise ArtifactError(f"fxinit cannot save a graph with op {n.target!r}",
                        hint="only aten ops, getitem and fxinit's opaque init functions are saved")


def _encode(x: Any, names: dict[fx.Node, str]) -> Any:
    if isinstance(x, fx.Node):
        return {"node": names[x]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (list, tuple)):
        return {"list" if isinstance(x, list) else "tuple": [_encode(v, names) for v in x]}
    if isinstance(x, complex):
        return {"complex": [x.real, x.imag]}
    if isinstance(x, torch.dtype):
        return {"dtype": _dtype_name(x)}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, torch.layout):
        return {"layout": str(x).removeprefix("torch.")}
    if isinstance(x, torch.memory_format):
        return {"memory_format": str(x).removeprefix("torch.")}
    raise ArtifactError(f"fxinit cannot save an op argument of type {type(x).__name__}: {x!r}",
                        hint="please report the model that records it")


def _encode_node(n: fx.Node, names: dict[fx.Node, str]) -> dict[str, Any]:
    m = n.meta
    spec = m.get("spec")
    prov = m.get("prov")
    return {
        "name": n.name,
        "op": n.op,
        "target": _target_name(n),
        "args": _encode(tuple(n.args), names),
        "kwargs": {k: _encode(v, names) for k, v in n.kwargs.items()},
        "pos": int(m.get("pos", 0)),
        "spec": None if spec is None else [list(spec.shape), list(spec.stride), spec.storage_offset,
                                           _dtype_name(spec.dtype), str(spec.device)],
        "reads": list(m.get("reads", ())),
        "mutates": list(m.get("mutates", ())),
        "overwrites": list(m.get("overwrites", ())),
        "rng": dict(m["generators"]) if m.get("generators") else None,  # the file's name for them
        "prov": None if prov is None else [prov.source, prov.init_fn, prov.module_class, prov.init_method],
        "module": m.get("module"),
        "opaque": m.get("opaque"),
        "body": m.get("body"),
        "default_dtype": _dtype_name(m["default_dtype"]) if "default_dtype" in m else None,
        **({"inexact": m["inexact"]} if m.get("inexact") else {}),
        **({"numerics": _encode_numerics(m["numerics"])} if "numerics" in m else {}),
    }


def _encode_numerics(numerics: Numerics | None) -> list | None:
    return None if numerics is None else [[name, list(v) if isinstance(v, tuple) else v] for name, v in numerics]


def _decode_numerics(x: Any, where: str) -> Numerics:
    """Settings as ``fxinit.numerics`` holds them; a setting this torch lacks (a later
    release's) is kept, and not set when ops replay."""
    _expect(isinstance(x, list) and len(x) <= 64, f"{where}: numerics")
    pairs = []
    for item in x:
        _expect(isinstance(item, list) and len(item) == 2 and isinstance(item[0], str), f"{where}: numerics")
        name, value = item[0], tuple(item[1]) if isinstance(item[1], list) else item[1]
        _expect(check_value(name, value) if name in SETTINGS else
                isinstance(value, (bool, int, str)) or all(isinstance(v, bool) for v in value),
                f"{where}: setting {name!r} = {value!r}")
        pairs.append((name, value))
    return tuple(pairs)


# ---------------------------------------------------------------------------- load
def read_graph(path: str | os.PathLike) -> dict[str, Any]:
    """The fields of an InitGraph saved with ``InitGraph.save`` (its constructor's keyword
    arguments); refuses anything it cannot trust."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ArtifactError(f"cannot read {path}: {exc}") from exc
    return decode(data, source=str(path))


def decode(data: bytes, source: str = "<bytes>") -> dict[str, Any]:
    """``read_graph`` from the bytes of a file."""
    payload = unpack(data, source)
    try:
        graph = _decode(payload)
        _check_on_meta(graph["graph"], graph["constants"], graph["default_dtype"])
    except ArtifactError as exc:
        raise ArtifactError(f"{source}: {exc}") from exc
    except Exception as exc:  # a value of a wrong kind deep inside: refuse, never crash
        raise ArtifactError(f"{source}: invalid init graph ({type(exc).__name__}: {short_message(exc)})") from exc
    return graph


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise ArtifactError(f"invalid init graph: {what}")


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in x)


def _decode(p: Any) -> dict[str, Any]:
    _expect(isinstance(p, dict), "payload is not a dict")
    _expect(p.get("format") == FORMAT, "not an fxinit init graph payload")
    version = p.get("schema_version")
    _expect(isinstance(version, int), "no schema version")
    if version > SCHEMA_VERSION:
        raise ArtifactError(f"schema version {version} is newer than this fxinit reads ({SCHEMA_VERSION})",
                            hint="upgrade fxinit to load it")
    _expect(version in (1, 2, 3, 4, 5, 6, SCHEMA_VERSION), f"unknown schema version {version}")
    _expect(("hf_config" in p) == (version >= 2),
            f"a schema {version} payload {'without' if version >= 2 else 'with'} hf_config")
    _expect(p.get("default_dtype") in _DTYPES, "bad default dtype")
    _expect(p.get("seed") is None or (isinstance(p["seed"], int) and not isinstance(p["seed"], bool)), "bad seed")
    names = p.get("stream_names")
    _expect(isinstance(names, dict) and all(isinstance(k, int) and isinstance(v, str) for k, v in names.items()),
            "bad stream names")
    for key, kind in (("nodes", list), ("outputs", dict), ("output_storage", dict), ("info", dict),
                      ("ties", list), ("constants", dict), ("rng", dict)):
        _expect(isinstance(p.get(key), kind), f"field {key!r} missing or not a {kind.__name__}")
    _expect(len(p["nodes"]) <= MAX_NODES, "too many nodes")
    constants = p["constants"]
    for k, v in constants.items():
        _expect(isinstance(k, str) and isinstance(v, torch.Tensor), f"constant {k!r} is not a tensor")
    snapshots: dict[str, Snapshot] = {}
    pending: dict[str, dict] = {}
    for k, v in p["rng"].items():
        _expect(isinstance(k, str) and isinstance(v, dict), f"rng entry {k!r}")
        if set(v) == set(PENDING_FIELDS):
            pending[k] = v
            continue
        _expect(set(v) == {"device", "state"}, f"rng entry {k!r}")
        state, device = v["state"], v["device"]
        _expect(isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1,
                f"rng state {k!r} is not a byte tensor")
        _expect(isinstance(device, str), f"rng device of {k!r}")
        dev = torch.device(device)
        _expect(dev.type in ("cpu", "cuda"), f"rng device {device!r}")
        _expect(dev.type != "cpu" or state.numel() == _CPU_STATE_BYTES, f"rng state {k!r} has the wrong size")
        snapshots[k] = RngSnapshot(device=device, state=state)
    bad = decode_pending(pending, snapshots)
    _expect(not bad, f"rng entries {bad[:3]}: CUDA snapshots pending their device")

    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    last_pos = -1
    for i, rec in enumerate(p["nodes"]):
        node = _decode_node(graph, rec, env, constants, snapshots, i)
        _expect(node.meta["pos"] > last_pos, "node positions are not increasing")
        last_pos = node.meta["pos"]
    if version < 4:
        _fingerprint_older_opaque_nodes(graph, p.get("torch_version"))
    kernels = p.get("random_kernels")
    _expect((kernels is not None) == (version >= 6), f"a schema {version} payload with{'out' * (version >= 6)} "
                                                      "random_kernels")
    _expect(kernels is None or (isinstance(kernels, dict) and all(
        k in _DTYPES and isinstance(v, str) for k, v in kernels.items())), "bad random_kernels")
    _note_random_kernels(graph, kernels, p.get("torch_version"))
    _expect(("numerics" in p) == (version >= 7), f"a schema {version} payload with{'out' * (version >= 7)} numerics")
    numerics = None if p.get("numerics") is None else _decode_numerics(p["numerics"], "graph")
    outputs: dict[str, fx.Node] = {}
    for fqn, name in p["outputs"].items():
        _expect(isinstance(fqn, str) and isinstance(name, str) and name in env, f"output {fqn!r}")
        outputs[fqn] = env[name]
        _expect(outputs[fqn].meta.get("spec") is not None, f"output {fqn!r} has no tensor spec")
    graph.output({fqn: node for fqn, node in outputs.items()})
    storage = p["output_storage"]
    _expect(set(storage) == set(outputs) and all(isinstance(v, int) for v in storage.values()),
            "output storage ids do not match the outputs")
    info: dict[str, OutputInfo] = {}
    for fqn, v in p["info"].items():
        _expect(fqn in outputs and isinstance(v, list) and len(v) == 3 and all(isinstance(b, bool) for b in v),
                f"output info of {fqn!r}")
        info[fqn] = OutputInfo(requires_grad=v[0], is_parameter=v[1], persistent=v[2])
    _expect(set(info) == set(outputs), "output info does not cover the outputs")
    ties = p["ties"]
    for g in ties:
        _expect(isinstance(g, list) and len(g) > 1 and all(n in outputs for n in g), "tie group")
    return dict(graph=graph, outputs=outputs, output_storage=dict(storage), info=info,
                ties=[list(g) for g in ties], constants=dict(constants), snapshots=snapshots,
                default_dtype=_DTYPES[p["default_dtype"]], numerics=numerics, seed=p.get("seed"),
                stream_names=dict(names),
                hf_config=_checked_config(p.get("hf_config"), "invalid init graph"))


def _checked_config(config: Any, problem: str) -> dict[str, Any] | None:
    """``config`` if it is None or plain JSON data (a dict with str keys; str, int, float,
    bool, None, lists and dicts inside) of bounded depth and size, else ArtifactError."""
    if config is None:
        return None
    if type(config) is not dict:
        raise ArtifactError(f"{problem}: hf_config is a {type(config).__name__}, not a dict")
    items = 0
    pending: list[tuple[Any, str, int]] = [(config, "hf_config", 0)]
    while pending:
        value, where, depth = pending.pop()
        items += 1
        if items > MAX_CONFIG_ITEMS:
            raise ArtifactError(f"{problem}: hf_config holds more than {MAX_CONFIG_ITEMS} values")
        if depth > MAX_CONFIG_DEPTH:
            raise ArtifactError(f"{problem}: {where[:200]} is nested deeper than {MAX_CONFIG_DEPTH} levels")
        if type(value) is dict:
            for k, v in value.items():
                if type(k) is not str:
                    raise ArtifactError(f"{problem}: {where} has a key of type {type(k).__name__}: {k!r}",
                                        hint="hf_config holds config.json data: keys are strings")
                pending.append((v, f"{where}[{k!r:.60}]", depth + 1))
        elif type(value) is list:
            pending.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
        elif value is not None and type(value) not in (str, int, float, bool):
            raise ArtifactError(f"{problem}: {where} is a {type(value).__name__}, not JSON data",
                                hint="hf_config holds config.json data: str, int, float, bool, None, lists "
                                     "and dicts")
    return config


_NODE_KEYS = {"name", "op", "target", "args", "kwargs", "pos", "spec", "reads", "mutates", "overwrites", "rng",
              "prov", "module", "opaque", "default_dtype"}  # schema 4 adds "body", 5 "inexact", 7 "numerics"


def _decode_node(graph: fx.Graph, rec: Any, env: dict[str, fx.Node], constants: dict[str, torch.Tensor],
                 snapshots: dict[str, Snapshot], i: int) -> fx.Node:
    _expect(isinstance(rec, dict) and set(rec) - {"body", "inexact", "numerics"} == _NODE_KEYS,
            f"node {i} has unexpected fields")
    name = rec["name"]
    _expect(isinstance(name, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) is not None
            and name not in env, f"node {i} name")
    op = rec["op"]
    _expect(op in ("call_function", "get_attr"), f"node {name}: kind {op!r}")

    def decode(x: Any) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        _expect(isinstance(x, dict) and len(x) == 1, f"node {name}: argument {x!r}")
        (kind, v), = x.items()
        if kind == "node":
            _expect(isinstance(v, str) and v in env, f"node {name}: refers to unknown or later node {v!r}")
            return env[v]
        if kind in ("list", "tuple"):
            _expect(isinstance(v, list), f"node {name}: {kind}")
            items = [decode(e) for e in v]
            return items if kind == "list" else tuple(items)
        if kind == "complex":
            _expect(isinstance(v, list) and len(v) == 2 and all(isinstance(e, float) for e in v), f"node {name}")
            return complex(*v)
        table = {"dtype": _DTYPES, "layout": _LAYOUTS, "memory_format": _MEMORY_FORMATS}.get(kind)
        if table is not None:
            _expect(v in table, f"node {name}: {kind} {v!r}")
            return table[v]
        if kind == "device":
            _expect(isinstance(v, str) and re.fullmatch(r"(cpu|cuda|meta)(:[0-9]+)?", v) is not None,
                    f"node {name}: device {v!r}")
            return torch.device(v)
        raise ArtifactError(f"invalid init graph: node {name}: argument kind {kind!r}")

    if op == "get_attr":
        _expect(rec["target"] in constants, f"node {name}: unknown constant {rec['target']!r}")
        node = graph.create_node("get_attr", rec["target"], name=name)
    else:
        target = _resolve_target(rec["target"], name)
        args = decode(rec["args"])
        _expect(isinstance(args, tuple), f"node {name}: args")
        _expect(isinstance(rec["kwargs"], dict) and all(isinstance(k, str) for k in rec["kwargs"]),
                f"node {name}: kwargs")
        kwargs = {k: decode(v) for k, v in rec["kwargs"].items()}
        if target is call_init_function:
            _check_opaque_call(name, args, kwargs)
        node = graph.create_node("call_function", target, args, kwargs, name=name)
        _expect(node.name == name, f"node {name}: name clash")
    _expect(isinstance(rec["pos"], int), f"node {name}: pos")
    meta: dict[str, Any] = {"pos": rec["pos"]}
    spec = rec["spec"]
    if spec is not None:
        _expect(isinstance(spec, list) and len(spec) == 5 and _is_int_list(spec[0]) and _is_int_list(spec[1])
                and isinstance(spec[2], int) and spec[3] in _DTYPES and isinstance(spec[4], str)
                and len(spec[0]) == len(spec[1]) and all(s >= 0 for s in spec[0]), f"node {name}: spec")
        meta["spec"] = TensorSpec(tuple(spec[0]), tuple(spec[1]), spec[2], _DTYPES[spec[3]], torch.device(spec[4]))
    else:
        meta["spec"] = None
    for key in ("reads", "mutates", "overwrites"):
        _expect(_is_int_list(rec[key]), f"node {name}: {key}")
        meta[key] = tuple(rec[key])
    if rec["rng"] is not None:
        keys = rec["rng"]
        _expect(isinstance(keys, dict) and keys and all(
            isinstance(k, str) and (k == "gen" or k.startswith("default:")) and v in snapshots for k, v in keys.items()),
            f"node {name}: rng keys")
        meta["generators"] = dict(keys)
    elif op == "call_function" and draws_random(node.target, node.args, node.kwargs):
        raise ArtifactError(f"invalid init graph: random op {name} has no generator snapshot")
    prov = rec["prov"]
    _expect(prov is None or (isinstance(prov, list) and len(prov) == 4
                             and all(v is None or isinstance(v, str) for v in prov)), f"node {name}: provenance")
    meta["prov"] = Provenance(*prov) if prov is not None else Provenance(None, None, None)
    for key in ("module", "opaque", "body", "inexact"):
        _expect(rec.get(key) is None or isinstance(rec[key], str), f"node {name}: {key}")
        if rec.get(key) is not None:
            meta[key] = rec[key]
    if rec["default_dtype"] is not None:
        _expect(rec["default_dtype"] in _DTYPES, f"node {name}: default dtype")
        meta["default_dtype"] = _DTYPES[rec["default_dtype"]]
    if "numerics" in rec:
        meta["numerics"] = _decode_numerics(rec["numerics"], f"node {name}")
    node.meta.update(meta)
    env[name] = node
    return node


def _fingerprint_older_opaque_nodes(graph: fx.Graph, recorded_with: Any) -> None:
    """Opaque nodes of a graph older than their ``body`` fingerprint (schema 4): the recording
    torch's function is this torch's where the versions agree; elsewhere it is unknown, and an
    exact replay is refused (``execute.refuse_changed_init_functions``; torch 2.11's
    ``trunc_normal_`` draws otherwise than 2.13's, so every later tensor would differ)."""
    same = isinstance(recorded_with, str) and _release(recorded_with) == _release(torch.__version__)
    for node in graph.nodes:
        if node.meta.get("opaque") and "body" not in node.meta:
            node.meta["body"] = (body_fingerprint(node.meta["opaque"]) if same
                                 else f"unknown: recorded with torch {recorded_with}")


def _random_kernels(nodes: Iterable[fx.Node]) -> dict[str, str]:
    """``{dtype: fingerprint}`` of the dtypes the CPU random ops among ``nodes`` draw in: those
    they were recorded with (``meta["kernels"]``, a graph loaded here), else this torch's."""
    out: dict[str, str] = {}
    for node in nodes:
        dtype = _cpu_random_dtype(node)
        if dtype is not None:
            out.setdefault(_dtype_name(dtype), node.meta.get("kernels") or fingerprint(dtype))
    return out


def _note_random_kernels(graph: fx.Graph, kernels: dict[str, str] | None, recorded_with: Any) -> None:
    """Each CPU random node's ``meta["kernels"]``: the fingerprint of the kernels it was
    recorded with (``execute.refuse_changed_kernels``). A graph older than them (schema 6):
    this torch's where the file names the same torch release, else unknown."""
    same = isinstance(recorded_with, str) and _release(recorded_with) == _release(torch.__version__)
    for node in graph.nodes:
        dtype = _cpu_random_dtype(node)
        if dtype is None:
            continue
        if kernels is not None:
            _expect(_dtype_name(dtype) in kernels, f"node {node.name}: no random_kernels entry for {dtype}")
            node.meta["kernels"] = kernels[_dtype_name(dtype)]
        else:
            node.meta["kernels"] = fingerprint(dtype) if same else f"unknown: recorded with torch {recorded_with}"


def _cpu_random_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype a random op on the CPU draws in (the tensor it fills), or None."""
    if node.op != "call_function" or not draws_random(node.target, node.args, node.kwargs):
        return None
    spec = node.meta.get("spec")
    if spec is None and node.args and isinstance(node.args[0], fx.Node):
        spec = node.args[0].meta.get("spec")  # an init function recorded whole fills its first argument
    return spec.dtype if spec is not None and spec.device.type == "cpu" else None


def _release(version: str) -> str:
    """``2.13.0`` of ``2.13.0+cpu``: builds of one release run the same Python init functions."""
    return version.split("+")[0]


def _check_opaque_call(name: str, args: tuple, kwargs: dict[str, Any]) -> None:
    """An opaque node must call an allowed init function with arguments it accepts."""
    _expect(len(args) >= 2 and args[0] in OPAQUE_INIT_FUNCTIONS and isinstance(args[1], fx.Node),
            f"node {name}: init function {args[:1]!r}")
    _expect(kwargs.get("generator") is None, f"node {name}: generator argument")
    _expect(isinstance(kwargs.get("default_device", torch.device("cpu")), torch.device), f"node {name}: default device")
    kwargs = {k: v for k, v in kwargs.items() if k != "default_device"}
    numbers = [*args[2:], *(v for k, v in kwargs.items() if k != "generator")]
    _expect(all(isinstance(v, (int, float)) for v in numbers), f"node {name}: init function arguments")
    try:
        inspect.signature(resolve_init_function(args[0])).bind(None, *args[2:], **kwargs)
    except TypeError as exc:
        raise ArtifactError(f"invalid init graph: node {name}: {args[0]} does not accept these arguments "
                            f"({exc})") from exc


def _resolve_target(name: Any, node: str) -> Callable[..., Any]:
    _expect(isinstance(name, str), f"node {node}: target")
    if name == _GETITEM:
        return operator.getitem
    if name == _OPAQUE:
        return call_init_function
    m = _ATEN_NAME.fullmatch(name)
    if m is None or m.group(1) in _DENIED_ATEN:
        raise ArtifactError(f"invalid init graph: node {node}: op {name!r} is not allowed",
                            hint="saved graphs may only use aten ops, getitem and fxinit's opaque init functions")
    try:
        packet = getattr(torch.ops.aten, m.group(1))
        overload = getattr(packet, m.group(2))
    except (AttributeError, RuntimeError) as exc:
        raise ArtifactError(f"invalid init graph: node {node}: unknown op {name!r} in torch {torch.__version__}",
                            hint="the graph was saved by a torch that has ops this one lacks") from exc
    return overload


def _check_on_meta(graph: fx.Graph, constants: dict[str, torch.Tensor], default_dtype: torch.dtype) -> None:
    """Run the graph on the meta device: every op must accept its arguments and produce
    the shape, stride and dtype the file declares for it."""
    env: dict[fx.Node, Any] = {}

    def load(x: Any) -> Any:
        return env[x] if isinstance(x, fx.Node) else x

    meta = torch.device("meta")
    for n in graph.nodes:
        if n.op == "output":
            continue
        spec = n.meta.get("spec")
        if n.op == "get_attr":
            c = constants[n.target]
            value: Any = torch.empty_strided(c.size(), c.stride(), dtype=c.dtype, device=meta)
        elif n.target is call_init_function:
            value = load(n.args[1])
        else:
            args = fx.node.map_aggregate(n.args, load)
            kwargs = dict(fx.node.map_aggregate(n.kwargs, load))
            if "device" in kwargs:
                kwargs["device"] = meta
            kwargs.pop("generator", None)
            args = replay_args(n.target, args)
            dtype = n.meta.get("default_dtype", default_dtype)
            saved = torch.get_default_dtype()
            try:
                torch.set_default_dtype(dtype) if dtype.is_floating_point else None
                value = META_RESULTS.get(n.target, n.target)(*args, **kwargs)
            except ArtifactError:
                raise
            except NotImplementedError:
                if spec is None:
                    raise
                # meta cannot tell (a shape that depends on values: indexing by a mask, which
                # capture computed): the declared layout stands, the op checks its arguments
                # when it runs
                span = 0 if 0 in spec.shape else 1 + sum((n - 1) * st for n, st in zip(spec.shape, spec.stride))
                value = torch.empty(spec.storage_offset + span, dtype=spec.dtype, device=meta).as_strided(
                    spec.shape, spec.stride, spec.storage_offset)
            except Exception as exc:
                raise ArtifactError(f"invalid init graph: node {n.name} ({n.target}) fails on its own "
                                    f"arguments: {type(exc).__name__}: {short_message(exc)}") from exc
            finally:
                torch.set_default_dtype(saved)
        if spec is not None:
            _expect(isinstance(value, torch.Tensor) and tuple(value.shape) == spec.shape
                    and tuple(value.stride()) == spec.stride and value.dtype == spec.dtype
                    and value.storage_offset() == spec.storage_offset,
                    f"node {n.name}: declares {spec.shape}/{spec.dtype}, computes "
                    f"{getattr(value, 'shape', type(value).__name__)}/{getattr(value, 'dtype', '')}")
        env[n] = value
