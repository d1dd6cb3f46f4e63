"""The server's own copies of the bundles it serves: read once, checked, content-addressed.

``preft serve`` never serves a bundle from the user's directory. When an adapter is given at
start-up or loaded at run time, :meth:`BundleStore.add` copies the bundle's files into a
temporary directory inside the store, checks that copy (:func:`check_bundle`: manifest and its
rule, kind, rank, base model, complete and finite weights, by :mod:`preft.bundle`'s checks), and
renames it to ``STORE/<sha256 of its files>``. The engine reads only that copy, so a bundle
that is later deleted, moved or re-exported in place cannot change or crash what is served, and
a re-exported bundle loaded again is a new directory with its new weights (never a stale cache
hit).

Runtime loads may only name directories under the server's adapter root
(:func:`resolve_under_root`): the path is resolved (``..`` and links followed) before the
check, and a path outside it is refused without saying whether it exists.

The engine trusts the store alone (:func:`is_store_copy`): under ``preft serve`` the engine core
and the workers serve a bundle only if its path is ``STORE/<64 hex digits>``, judged from the
path before anything is read; a request naming any other path, by whatever route it came, fails
alone with :data:`NOT_SERVED`, which says nothing of that path. The worker also checks a ReFT-P
copy's files against its digest when it writes them into its bank (:func:`intact_store_copy`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from preft import envs
from preft.bundle import (BUNDLE_FILES, MANIFEST, BundleError, base_fingerprint, bundle_rule, check_finite,
                          check_lora, check_reft, has_manifest, load_tensors, read_json, read_manifest)


def check_bundle(name: str, path: str | Path, base: dict, max_rank: int) -> dict:
    """Refuse a bundle that this server cannot serve (``base``: :func:`preft.bundle.base_fingerprint`
    of the served model); returns its manifest."""
    if not Path(path).is_dir():
        raise BundleError(f"adapter {name!r}: bundle directory not found: {path}")
    manifest = read_manifest(path)
    if manifest.get("kind") not in BUNDLE_FILES:
        raise BundleError(f"adapter {name!r}: unknown bundle kind {manifest.get('kind')!r}")
    rank = manifest.get("rank")
    if not isinstance(rank, int) or rank <= 0:
        raise BundleError(f"adapter {name!r}: the manifest's rank {rank!r} is not a positive integer")
    if rank > max_rank:
        raise BundleError(f"adapter {name!r}: rank {rank} is over --max-rank {max_rank}")
    recorded = manifest.get("base") if isinstance(manifest.get("base"), dict) else {}
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
        if recorded.get(key) != base.get(key):
            raise BundleError(
                f"adapter {name!r} was exported for another base model: {key} is {recorded.get(key)} "
                f"in the bundle, {base.get(key)} in the served model"
            )
    if manifest["kind"] == "lora":
        tensors = load_tensors(Path(path) / "adapter_model.safetensors")
        config = read_json(Path(path) / "adapter_config.json", "adapter config")
        if not isinstance(config, dict) or check_lora(tensors, config, base, max_rank) != rank:
            raise BundleError(f"adapter {name!r}: adapter_config.json does not match the manifest's rank {rank}")
    else:
        tensors = load_tensors(Path(path) / "reft_weights.safetensors")
        try:
            check_reft(manifest, tensors, base, max_rank)
        except BundleError as err:
            raise BundleError(f"adapter {name!r}: {err}") from None
    check_finite(tensors)
    return manifest


#: a store copy's directory name: the sha256 of its files
STORE_COPY_NAME = re.compile(r"[0-9a-f]{64}")
#: why a request naming a bundle that is not a store copy fails (it names no path)
NOT_SERVED = "the adapter bundle this request names is not one this server has loaded; name a served adapter in 'model'"


def is_store_copy(path) -> bool:
    """Whether ``path`` names a copy in this server's store, ``STORE/<sha256>``, judged from the
    path string alone (nothing is read, so the answer says nothing of other paths). With no store
    (an engine outside ``preft serve``, such as a script's ``vllm.LLM``: whoever runs it names
    its own bundles) every path is accepted."""
    store = envs.PREFT_SERVE_STORE
    if not store:
        return True
    if not isinstance(path, str) or not path:
        return False
    parent, name = os.path.split(os.path.abspath(path))
    return parent == os.path.abspath(store) and STORE_COPY_NAME.fullmatch(name) is not None


def intact_store_copy(kind: str, path: str) -> bool:
    """Whether the store copy at ``path`` still holds exactly the files its name is the digest of
    (always true with no store)."""
    if not envs.PREFT_SERVE_STORE:
        return True
    return is_store_copy(path) and _intact(Path(path), BUNDLE_FILES[kind], Path(path).name)


def served_copy_problem(kind: str, path: str) -> str | None:
    """Why the bundle at ``path`` cannot be served now, or None: it is not one of the server's
    store copies (:func:`is_store_copy`; nothing is read then), its rule cannot be read, or a
    file its kind needs is gone. The engine asks when a request arrives, so such a request fails
    alone (a plain vLLM LoRA directory, with no manifest, is vLLM's to check outside ``preft
    serve``)."""
    if not is_store_copy(path):
        return NOT_SERVED
    try:
        bundle_rule(path)
    except Exception as err:  # noqa: BLE001 - any unreadable manifest fails the request, not the engine
        return str(err)
    if kind == "lora" and not has_manifest(path):
        return None
    missing = [file for file in (MANIFEST, *BUNDLE_FILES[kind]) if not (Path(path) / file).is_file()]
    return f"{path}: the bundle's {missing[0]} is gone" if missing else None


def resolve_under_root(path: str, root: Path) -> Path:
    """``path`` resolved, if it lies under ``root`` (resolved too); else an error that names
    neither the path nor whether it exists."""
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise BundleError("lora_path is outside the server's adapter root (preft serve --adapter-root)")
    return resolved


def _digest(directory: Path, files: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for name in (MANIFEST, *files):
        digest.update(name.encode() + b"\0" + (directory / name).read_bytes() + b"\0")
    return digest.hexdigest()


def _file_states(directory: Path, files: tuple[str, ...]) -> list[tuple[int, int, int]]:
    """Each file's (inode, size, modification time in ns): a rewrite or a replacement changes one."""
    states = []
    for name in files:
        try:
            stat = (directory / name).stat()
        except OSError:
            states.append((0, -1, 0))
            continue
        states.append((stat.st_ino, stat.st_size, stat.st_mtime_ns))
    return states


def _intact(copy: Path, files: tuple[str, ...], digest: str) -> bool:
    """Whether the store copy ``copy`` still holds exactly the files its name (``digest``) says."""
    try:
        return copy.is_dir() and _digest(copy, files) == digest
    except OSError:
        return False


class BundleStore:
    """Content-addressed copies of bundles under ``root`` (the server's state directory)."""

    def __init__(self, root: str | Path, base_dir: Path, max_rank: int) -> None:
        self.root, self.base_dir, self.max_rank = Path(root), Path(base_dir), max_rank
        self.root.mkdir(parents=True, exist_ok=True)

    @functools.cached_property
    def base(self) -> dict:
        """The served model's fingerprint (its config and weight shapes), read once, on the first add."""
        return base_fingerprint(self.base_dir)

    def add(self, name: str, source: str | Path) -> tuple[Path, dict]:
        """Copy, check and file the bundle at ``source``; ``(its copy in the store, manifest)``."""
        source = Path(source)
        if not source.is_dir():
            raise BundleError(f"adapter {name!r}: bundle directory not found: {source}")
        kind = read_manifest(source).get("kind")
        if kind not in BUNDLE_FILES:
            raise BundleError(f"adapter {name!r}: unknown bundle kind {kind!r}")
        staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=self.root))
        try:
            files = (MANIFEST, *BUNDLE_FILES[kind])
            for file in files:
                if not (source / file).is_file():
                    raise BundleError(f"adapter {name!r}: the bundle has no {file}")
            before = _file_states(source, files)
            for file in files:
                shutil.copyfile(source / file, staging / file)
            if _file_states(source, files) != before:  # a copy mixing two versions of the bundle is never served
                raise BundleError(f"adapter {name!r}: the bundle changed while it was being read; load it again "
                                  "once it is written")
            manifest = check_bundle(name, staging, self.base, self.max_rank)  # what is served is what is checked
            if manifest.get("kind") != kind:
                raise BundleError(f"adapter {name!r}: the bundle changed while it was being read")
            digest = _digest(staging, BUNDLE_FILES[kind])
            target = self.root / digest
            if _intact(target, BUNDLE_FILES[kind], digest):
                shutil.rmtree(staging)
            else:  # new, or a copy damaged behind the server's back: this one replaces it
                if target.exists():
                    stale = Path(tempfile.mkdtemp(prefix=".stale-", dir=self.root))
                    os.rename(target, stale / "copy")
                    shutil.rmtree(stale, ignore_errors=True)
                os.rename(staging, target)
            return target, manifest
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
