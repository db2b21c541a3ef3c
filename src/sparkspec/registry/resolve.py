"""Resolving a host once: which method it serves (the inventory, a switch, or the switch recorded on
the host), its profile and staged profiles with their folders, the merged serve knobs and verify
floors, and what it downloads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import sparkspec.registry.releases as releases
from sparkspec.errors import UserError
from sparkspec.registry.cluster import resolve_cluster
from sparkspec.registry.data import (
    BUILTIN_METHODS,
    DFLASH_BACKENDS,
    DFLASH_REVISIONS,
    HEAD_KINDS,
    NEEDLE_ANSWER_TOKENS,
    RENAMED,
    SERVE_DEFAULTS,
    VERIFY_DEFAULTS,
)
from sparkspec.registry.fields import key, show
from sparkspec.registry.levers import check_levers, merge_levers, plugin_levers, serve_values
from sparkspec.registry.schema import (
    _fail,
    _mapping,
    check_contract,
    check_method,
    check_pinned,
    check_profile,
    check_serve,
    check_tuned_k,
    check_verify,
)
from sparkspec.validate import repo_id


def check_renamed(names: Iterable[str]) -> None:
    """One line for the first variable the inventory
    still sets under a name this version renamed."""
    for name in sorted(set(names)):
        if name in RENAMED:
            raise _fail(name, f"renamed in sparkspec 0.2.0; set {RENAMED[name]} instead "
                              "(CHANGELOG.md)")


def _pick(profiles: Any, name: Any, var: str) -> Any:
    table = _mapping(profiles, "sparkspec_profiles", "give a mapping of profile name to profile")
    if not isinstance(name, str) or name not in table:
        raise _fail(var, f"{show(name)} is not a key of sparkspec_profiles (known: "
                    f"{', '.join(key(k) for k in table) or 'none'}); set it to one of them")
    return table[name]


def lookup_profile(profiles: Any, name: Any, dirs: Mapping[str, str],
                   var: str = "sparkspec_profile") -> dict[str, Any]:
    """The one profile lookup: ``profiles[name]``,
    checked, or an error listing the known profiles."""
    return check_profile(name, _pick(profiles, name, var), dirs)


def defined_methods(methods: Any = None) -> dict[str, Any]:
    """The built-in methods (sparkspec.registry.data) with the inventory's sparkspec_methods on top
    (its own methods, each replacing a built-in of the same name)."""
    table: dict[str, Any] = dict(BUILTIN_METHODS)
    table.update(_mapping(methods or {}, "sparkspec_methods",
                          "give a mapping of method name to method"))
    return table


def _merge(defaults: Mapping[str, Any], *layers: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(defaults)
    for layer in layers:
        out.update(layer)
    return out


def choose_method(inventory: str, switch: str | None, record: Mapping[str, Any] | None,
                  now: str) -> dict[str, Any]:
    """Say what wins between the inventory's method,
    an explicit switch and the switch recorded on the host.

    Returns the method, where it came from (inventory | switch | recorded),
    a note for the play (empty when there is nothing to say), and what to
    do with the record: write (a new switch), remove, keep or none.
    """
    record = dict(record) if isinstance(record, Mapping) and record.get("method") else None
    if switch:
        if switch == inventory:
            return {"method": switch, "source": "switch", "note": "", "record": None,
                    "action": "remove" if record else "none"}
        same = record is not None and (record["method"],
                                       record.get("inventory_method")) == (switch, inventory)
        new = record if same else {"method": switch, "inventory_method": inventory, "time": now}
        return {"method": switch, "source": "switch", "record": new,
                "action": "keep" if same else "write",
                "note": f"switch to {switch} recorded on the host; a provision keeps it while the "
                        f"inventory says {inventory}; go back with: invoke deploy --method "
                        f"{inventory}"}
    if record is None:
        return {"method": inventory, "source": "inventory", "note": "", "record": None,
                "action": "none"}
    if record.get("inventory_method") == inventory and record["method"] != inventory:
        return {"method": record["method"], "source": "recorded", "record": record,
                "action": "keep",
                "note": f"serving {record['method']}, switched to at {record.get('time', '?')} "
                        f"(the switch wins while the inventory still says {inventory}); go back "
                        f"with: invoke deploy --method {inventory}"}
    return {"method": inventory, "source": "inventory", "record": None, "action": "remove",
            "note": f"the inventory's method {inventory} wins over the earlier switch to "
                    f"{record['method']} (made when it said {record.get('inventory_method')}); "
                    "switch record removed"}


def resolve(contract: Mapping[str, Any], record: Mapping[str, Any] | None = None,
            now: str = "", set_names: Iterable[str] = (),
            cluster: Mapping[str, Any] | None = None,
            release_record: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Everything the roles need for one host, from the contract's variables (sparkspec_<key>
    without the prefix, for each key of sparkspec.registry.data.CONTRACT_KEYS), the switch recorded
    on the host (None: none) and the names of the variables the inventory sets (``set_names``: a
    renamed one is refused in one line). ``cluster``: where sparkspec_cluster is set, {me, members,
    accelerator} for :func:`sparkspec.registry.cluster.resolve_cluster` (members: the group's hosts
    to their sparkspec_cluster_node); ``release_record``: the release switch recorded on the host
    (:func:`sparkspec.registry.releases.choose_release`)."""
    check_renamed(set_names)
    dirs = check_contract(contract)
    methods = defined_methods(contract.get("methods"))
    inventory = contract["method"]
    chosen = choose_method(inventory, contract.get("method_switch") or None, record, now)
    name = chosen["method"]
    if name not in methods:
        var = "sparkspec_method_switch" if chosen["source"] == "switch" else "sparkspec_method"
        raise _fail(var, f"unknown method {show(name)}; choose one of {', '.join(methods)} (or "
                    "define it in sparkspec_methods)")
    checked = {m: check_method(m, entry) for m, entry in methods.items()}
    method = checked[name]
    # every profile is checked, served and staged or not: a misspelt key anywhere stops the play
    profiles = {p: check_profile(p, entry, dirs) for p, entry in contract["profiles"].items()}
    if contract.get("require_pinned_revisions"):
        for pname, checked_profile in profiles.items():
            check_pinned(checked_profile, f"sparkspec_profiles.{key(pname)}")
    profile = _pick(profiles, contract.get("profile"), "sparkspec_profile")
    stage = contract.get("stage_profiles") or [profile["name"]]
    staged = [_pick(profiles, s, "sparkspec_stage_profiles") for s in dict.fromkeys(stage)]
    spec = method["speculative_config"]
    tuned = check_tuned_k(contract.get("num_speculative_tokens"), checked)
    k_source = None if spec is None else (
        "sparkspec_num_speculative_tokens" if name in tuned else
        f"sparkspec_methods.{name}" if name in (contract.get("methods") or {}) else
        f"registry ({name})")
    if name in tuned:
        spec = {**spec, "num_speculative_tokens": tuned[name]}
    served = releases.choose_release(contract.get("vllm_release") or releases.DEFAULT,
                                     contract.get("vllm_release_switch") or None, release_record,
                                     now, contract.get("vllm_release_restore") or None)
    active = releases.RELEASES[served["version"]]
    releases.check_spec(spec, active, f"sparkspec_methods.{key(name)}.speculative_config")
    install_mode = str((cluster or {}).get("install_mode") or "existing")
    # wheel and source modes keep one venv per release beside each other; an existing venv is the
    # owner's own, at the contract's path
    own = (contract["vllm_venv"] if install_mode == "existing"
           else f"{contract['vllm_venv']}-{active.version}")
    venv = method["vllm_venv"] or profile["vllm_venv"] or own
    if spec is not None and spec["method"] == "dflash":
        # the install mode built only the contract's venv: another is a vLLM sparkspec did not make
        mode = install_mode if venv == own else "existing"
        spec, k_source = _dflash(spec, k_source, profile["heads"].get(method["head"] or ""), mode)
    if method["head"] is not None:
        if method["head"] not in profile["heads"]:
            raise _fail(f"sparkspec_methods.{name}.head",
                        f"method {name} needs a {method['head']} head, and "
                        f"profile {profile['name']} has none (heads: "
                        f"{', '.join(profile['heads']) or 'none'}); add one under "
                        f"sparkspec_profiles.{profile['name']}.heads or choose another method")
        if spec is not None:
            spec = {**spec, "model": profile["heads"][method["head"]]["folder"]}
    host_serve = check_serve(contract.get("serve"), "sparkspec_serve")
    host_verify = check_verify(contract.get("verify"), "sparkspec_verify")
    levers = merge_levers(profile["levers"], method["levers"],
                          check_levers(contract.get("levers"), "sparkspec_levers"))
    serve = {**_merge(SERVE_DEFAULTS, profile["serve"], method["serve"], host_serve),
             **serve_values(levers)}
    # the default: off for hybrid profiles (Gated-DeltaNet layers)
    if serve["enable_prefix_caching"] is None:
        serve["enable_prefix_caching"] = profile["kind"] != "hybrid"
    where = dict(cluster or {})
    placed = resolve_cluster(contract.get("cluster"), where.get("members") or {},
                             str(where.get("me", "")),
                             speculative=spec["method"] if spec is not None else None,
                             accelerator=str(where.get("accelerator", "gb10")))
    plugin = plugin_levers(levers)
    if plugin and placed is not None and (placed["ray"] is not None
                                          or placed["pipeline_parallel_size"] > 1):
        # Ray: vLLM's Ray workers run in Ray's processes, without the unit's
        # environment (SPARKSPEC_LEVERS); pipeline parallel: the LM head lives
        # on the last stage, whose journal the head's deploy never reads
        why = ("vLLM's Ray workers do not get the unit's environment" if placed["ray"] is not None
               else "the LM head lives on the last pipeline stage, not on the head")
        raise _fail("sparkspec_levers", f"{', '.join(plugin)} cannot apply on this cluster "
                    f"({why}); serve it with backend mp and tensor parallel only, or turn the "
                    "levers off (sparkspec_levers: {LEVER: false})")
    floors = {m: _merge(VERIFY_DEFAULTS, profile["verify"], c["verify"],
                        host_verify) for m, c in checked.items()}
    _needle_fits(floors[name]["needle_tiers"], serve.get("max_model_len"), name)
    return {"method": name, "method_source": chosen["source"], "method_note": chosen["note"],
            "inventory_method": inventory,
            "desired": {"action": chosen["action"], "record": chosen["record"],
                        "previous": dict(record) if isinstance(record, Mapping) else None},
            "methods": list(methods), "head": method["head"], "serve": serve,
            "speculative_config": spec, "k_source": k_source, "levers": levers,
            "plugin_levers": plugin,
            "head_kind": (spec["method"] if spec is not None and spec["method"] in HEAD_KINDS
                          else None),
            "verify": floors[name], "floors": floors,
            "venv": venv,
            "release": {**releases.facts(active), "previous": served["previous"],
                        "note": served["note"], "record": served["record"],
                        "prior_record": (dict(release_record)
                                         if isinstance(release_record, Mapping) else None)},
            "profile": profile, "staged": staged, "disk_gb": sum(p["disk_gb"] for p in staged),
            # one Spark, or a cluster's head (rank 0):
            # the node that serves HTTP, verifies and reports
            "cluster": placed, "leads": placed is None or placed["rank"] == 0}


def _needle_fits(tiers: list[int] | None, max_model_len: Any, method: str) -> None:
    """The needle check's longest tier leaves its answer room in the served context."""
    if tiers and isinstance(max_model_len, int) \
            and tiers[-1] > max_model_len - NEEDLE_ANSWER_TOKENS:
        raise _fail("verify.needle_tiers", f"{tiers[-1]} tokens is above what {method} serves: "
                    f"max_model_len {max_model_len} less the answer's {NEEDLE_ANSWER_TOKENS} "
                    "tokens; lower the tier or raise max_model_len")


def _dflash(spec: dict[str, Any], k_source: str | None, head: Mapping[str, Any] | None,
            install_mode: str) -> tuple[dict[str, Any], str | None]:
    """A DFlash speculative_config with the facts filled in: the k of the drafter revision the head
    pins where the registry sets k (DFLASH_REVISIONS), and the drafter's backend of the install mode
    where the method sets none (DFLASH_BACKENDS)."""
    if install_mode not in DFLASH_BACKENDS:
        raise _fail("vllm_install_mode",
                    f"{show(install_mode)}; use one of {', '.join(DFLASH_BACKENDS)}")
    revision = str((head or {}).get("revision", ""))
    pinned = next((short for short in DFLASH_REVISIONS if revision.startswith(short)), None)
    if pinned is not None and k_source is not None and k_source.startswith("registry"):
        spec = {**spec, "num_speculative_tokens": DFLASH_REVISIONS[pinned]["k"]}
        k_source = f"registry (dflash, drafter {pinned})"
    if "attention_backend" not in spec:
        spec = {**spec, "attention_backend": DFLASH_BACKENDS[install_mode]}
    return spec, k_source


def _download(profile: str, mode: str, src: Mapping[str, str], **extra: str) -> dict[str, Any]:
    return {"profile": profile, "mode": mode, "repo": src["repo"], "revision": src["revision"],
            "dest": src["folder"], "repo_folder": src["repo_folder"], **extra}


def downloads(resolved: Mapping[str, Any], heads: str = "all") -> list[dict[str, Any]]:
    """What a host fetches, in order, for every staged profile of a resolved host: the model (plain)
    or the INT4 source and then the FP8 subset that reads it (hybrid), then the heads: all of them
    (``heads='all'``) or only the head of the method served (``'method'``)."""
    out: list[dict[str, Any]] = []
    for profile in resolved["staged"]:
        sources, pname = profile["sources"], profile["name"]
        if profile["kind"] == "hybrid":
            out.append(_download(pname, "repo", sources["int4"]))
            if "fp8" in sources:
                out.append(_download(pname, "fp8-subset", sources["fp8"],
                                     int4=sources["int4"]["folder"]))
        else:
            out.append(_download(pname, "repo", sources["model"]))
        out += [_download(pname, "repo", src) for name, src in profile["heads"].items()
                if heads == "all" or name == resolved["head"]]
    return out


# the hand-off root's one org: local/<name>, as docs/hub.md's hand-off lays it out
HANDOFF_ORG = "local"


def handoffs(resolved: Mapping[str, Any], heads: str = "all",
             root: str = "") -> list[dict[str, Any]]:
    """What a cluster head hands its workers (through ``hub serve``) for a resolved host, once per
    folder, in order: every staged profile's served folder (the hybrid it assembled, or the plain
    model), then its heads (all, or the method's: as :func:`downloads` fetched them). Each item is
    :func:`handoff_folder`'s, its ``dest`` the same path as on the head. [] outside a cluster.
    ``root``: the hand-off root the head removes and makes anew each run; a folder at, in or around
    it is refused (the removal would take it)."""
    if resolved.get("cluster") is None:
        return []
    out: list[dict[str, Any]] = []
    taken: dict[str, str] = {}
    for profile in resolved["staged"]:
        pname = profile["name"]
        folders = [(f"sparkspec_profiles.{pname}", profile["model_dir"])] + [
            (f"sparkspec_profiles.{pname}.heads.{kind}", src["folder"])
            for kind, src in profile["heads"].items() if heads == "all" or kind == resolved["head"]]
        for where, folder in folders:
            if folder in taken.values():
                continue
            item = handoff_folder(folder, root, where, "sparkspec_models_dir")
            repo = item["repo"]
            if repo in taken:
                raise _fail(where, f"its folder {folder} and {taken[repo]} would both be served to "
                                   f"the workers as {repo}; give one of them another folder name")
            taken[repo] = folder
            out.append({"profile": pname, **item})
    return out


def handoff_folder(folder: str, root: str, where: str, setting: str,
                   dest: str = "") -> dict[str, Any]:
    """One folder a cluster head hands over: ``folder`` (its path on the head), ``dest``
    (where a worker's fetch writes it: ``folder`` unless given, e.g. a staging folder the
    worker's root copies from), the repo it is served as (``local/<folder's name>``, '--'
    written '.': the hub's repo names hold no '--'), its ``name`` and the ``setting``
    that places it (named when it cannot be hard-linked into the hand-off root).
    ``where`` names the input in an error. Refused: a folder at, in or around ``root``
    (each hand-off removes and makes it anew) and a name the hub cannot serve."""
    inner, outer = f"{folder.rstrip('/')}/", f"{root.rstrip('/')}/"
    if root and (inner.startswith(outer) or outer.startswith(inner)):
        raise _fail(where, f"its folder {folder} is at, in or around the hand-off root {root}, "
                           "which each hand-off removes and makes anew; keep it outside "
                           "sparkspec_home/handoff")
    name = folder.rstrip("/").rsplit("/", 1)[-1].replace("--", ".")
    repo = f"{HANDOFF_ORG}/{name}"
    try:
        repo_id(repo)
    except UserError:
        raise _fail(where, f"its folder {folder} cannot be served to the workers as {show(repo)}; "
                           "name the folder with letters, digits, '-', '_' and '.'") from None
    return {"folder": folder, "dest": dest or folder, "repo": repo, "name": name,
            "setting": setting}


def handoff_items(handed: Iterable[Mapping[str, Any]], endpoint: str,
                  token_file: str) -> list[list[str]]:
    """A worker's ``sparkspec fetch batch --items``: one ``fetch repo`` per folder of
    :func:`handoffs` (or :func:`handoff_folder`), from the head's endpoint with the token file, into
    its ``dest`` (its hub serves ``main``)."""
    return [["repo", item["repo"], "--revision", "main", "--dest", item["dest"],
             "--endpoint", endpoint, "--token-file", token_file] for item in handed]
