"""Check the kvbm-backend connector's settings before an engine starts, and exit with one line naming
the field when they cannot work.

Why: vLLM creates KV connectors inside its worker processes. When our connector raises there (for
example ``g4.keyring.path`` missing with ``g4.encrypt`` on, or a KEK that cannot be read), vLLM 0.32's
engine core reports "Worker failed with error ..." but the API server process does not exit: seen with
``vllm serve`` on the CPU engine (the shipped example's G4 settings without a keyring: the server
stayed up, serving nothing, until killed). The launchers (``kvbm_backend.integrations.vllm.cli`` and
``kvbm_backend.integrations.dynamo.vllm_worker``) run :func:`check_argv` first, so such a
configuration stops before any engine process exists.

What is checked, for every ``KvbmBackendConnector`` in ``--kv-transfer-config`` (top level or a
``MultiConnector`` child) and every ``G3Tier``/``G4Tier`` of an ``OffloadingConnector``'s ``secondary_tiers``
(vLLM's native tiering; before 2026-11-30 those went unchecked): the settings parse into the config tree (every
field rule of :mod:`kvbm_backend.config`, G3 paths included), and with G4 encryption on or a ``g4.keyring.path``
set (a plaintext pool opens its keyring too) the keyring and its KEK open
(:meth:`kvbm_backend.crypto.keyring.Keyring.from_config`, exactly as the pool opens them). A dry run
(``create=False``: the scripts' ``KVBM_BACKEND_DRY_RUN``) creates nothing: an existing keyring is opened as
is, a missing one (the engine would create it and its KEK file) is left missing, its KEK (``$kek_env``, else an
existing KEK file) read. Before 2026-12-03 a keyring with ``g4.encrypt: false`` went unchecked, and so did a dry
run's KEK of a keyring not yet made.
With ``--disaggregation-mode prefill`` or ``decode`` (Dynamo's vLLM worker) and our connector as the engine's
only connector (the handoff through G4, ``examples/dynamo/disagg_*_g4.sh``; beside ``NixlConnector`` in a
``MultiConnector`` NIXL carries the KV and ours only caches), the handoff needs a G4 both workers share: G4 off
(or, on the prefill side, connector ``save`` or ``save_to_g4`` off) is refused, since the prefill worker's blocks
would reach no tier the decode worker reads (G3 is private to one worker). Before 2026-11-30 such a prefill worker
started, promised every prompt block, and each decode request waited ``handoff_wait_s`` for nothing.
The mode is Dynamo's: the flag, else its environment variable ``DYN_VLLM_DISAGGREGATION_MODE`` (the flag's
default in ``dynamo.vllm``'s parser, so the flag wins where both are given). Before 2026-11-30 the variable was not
read: a worker made a prefill worker by it (how a deployment's environment sets a role) passed the check, dry run
included, with G3 alone.
The ``--kv-transfer-config`` checked is the one vLLM resolves (:func:`check_argv`: the last flag, ``--config
FILE.yaml``, dotted ``--kv-transfer-config.KEY`` options, abbreviations such as ``--kv-transfer-conf``, through
vLLM's own parser). Before 2026-11-30 an abbreviated name (argparse's ``allow_abbrev``, which vLLM keeps on) went
unseen. ``--disaggregation-mode`` is read by its full name only: ``dynamo.vllm``'s own parser sets
``allow_abbrev=False`` (``--disaggregation-mod prefill`` is refused there as an unrecognized argument).
Storage reachability is not checked here: an unreachable G4 is a degraded tier, not a start-up error.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

CONNECTOR = "KvbmBackendConnector"
KTC = "--kv-transfer-config"
TIER_MODULE = "kvbm_backend.integrations.vllm.tiering"
MODE_ENV = "DYN_VLLM_DISAGGREGATION_MODE"
"""Dynamo's environment variable for ``--disaggregation-mode`` (``dynamo.vllm``: the flag's default)."""


def _arg(argv: list[str], name: str) -> str | None:
    """The value of option ``name`` (``--a-b``) as vLLM's parser takes it: the last occurrence wins, ``--a_b``
    is the same option, ``--a-b=V`` and ``--a-b V`` both count. (Before 2026-11-29 the first occurrence was
    checked: a launch script passes its own ``--kv-transfer-config`` and then the operator's arguments, so the
    operator's, the one vLLM uses, went unchecked.)"""
    found = None
    for i, a in enumerate(argv):
        flag, eq, val = a.partition("=")
        if not flag.startswith("--") or flag.replace("_", "-") != name:
            continue
        if eq:
            found = val
        elif i + 1 < len(argv):
            found = argv[i + 1]
    return found


def _vllm_values(argv: list[str]) -> list[str]:
    """Each value vLLM 0.32's own parser assigns to ``--kv-transfer-config`` for ``argv``, in order (the last is
    the one the engine uses; ``[]``: none given). Two steps, both vLLM's and argparse's code (no copy here):

    1. ``FlexibleArgumentParser.parse_args``'s preprocessing (``vllm/utils/argparse_utils.py``): ``--config
       FILE.yaml`` pulled in before the command line's options (lines 334-335, 479-567; a YAML mapping value
       becomes one JSON argument, 627-631), option names ``_`` -> ``-`` (344-356), dotted ``--NAME.a.b=V``
       options merged into one JSON ``--NAME`` appended after everything else (409-463).
    2. argparse's option resolution on that list, by the parser the engine's options go through: ``vllm serve``'s
       (``make_arg_parser``, ``argv[0] == "serve"``) else the engine parser ``dynamo.vllm`` hands vLLM's options to
       (``AsyncEngineArgs.add_cli_args``). ``FlexibleArgumentParser`` leaves argparse's ``allow_abbrev`` True, so
       an unambiguous prefix (``--kv-transfer-conf``, ``--kv_t=V``) is ``--kv-transfer-config``. Values are kept
       as given (no type conversion); other options are parsed and dropped.

    Importing vLLM costs seconds (torch), which the engine pays next anyway; :func:`check_argv` calls this only
    where :func:`_needs_vllm` says the answer can differ from the plain reading. Raises what vLLM raises
    (``OSError`` for an unreadable file, ``ValueError``, ``AssertionError`` for two ``--config``,
    ``yaml.YAMLError``) and ``ValueError`` for what argparse refuses (``ambiguous option: --kv could match ...``,
    a missing value). In a removed working directory vLLM is imported from ``/`` (torch ends the process there:
    :func:`kvbm_backend.workdir.guard_native_imports`; before 2026-12-03 ``Intel oneMKL FATAL ERROR``, exit 2)."""
    from ..workdir import guard_native_imports
    guard_native_imports()
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class _Seen(FlexibleArgumentParser):
        seen: list[str] = []

        def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
            self.seen = list(args or [])
            return argparse.Namespace(), []

    p = _Seen(add_help=False)
    p.parse_args(list(argv))
    serve = p.seen[:1] == ["serve"]
    ns = argparse.Namespace(kv_transfer_config=[])
    argparse.ArgumentParser.parse_known_args(_engine_parser(serve), p.seen[1:] if serve else p.seen, ns)
    return ns.kv_transfer_config


@functools.lru_cache(maxsize=2)
def _engine_parser(serve: bool) -> argparse.ArgumentParser:
    """vLLM's parser for ``vllm serve`` (``serve``) or for the engine's options alone, built by vLLM's code, with
    every action's type and choices dropped (values stay strings), help a no-op, errors raised (``ValueError``),
    and ``--kv-transfer-config`` appending each value it is given to the namespace's list."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class _Raising(FlexibleArgumentParser):
        def error(self, message: str):  # type: ignore[override]
            raise ValueError(message)

    class _Record(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            getattr(namespace, self.dest).append(values)

    class _Ignore(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            pass

    if serve:  # vllm/entrypoints/cli/serve.py: subparsers.add_parser("serve", ...) then make_arg_parser
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        parser = make_arg_parser(_Raising())
    else:  # dynamo/vllm/args.py: FlexibleArgumentParser(add_help=False); AsyncEngineArgs.add_cli_args(...)
        from vllm.engine.arg_utils import AsyncEngineArgs
        parser = _Raising(add_help=False)
        AsyncEngineArgs.add_cli_args(parser, async_args_only=False)
    for a in parser._actions:
        a.type, a.choices = None, None
        if a.dest == "kv_transfer_config":
            a.__class__ = _Record
        elif isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
            a.__class__ = _Ignore  # type: ignore[assignment]
    return parser


def _needs_vllm(argv: list[str]) -> bool:
    """Whether vLLM's parsing can change which ``--kv-transfer-config`` counts: a ``--config`` token (the exact
    test of argparse_utils.py line 334; ``--config=F`` is not pulled in by vLLM either), a dotted option name
    (line 425), or an option name that argparse could take as an abbreviation of ``--kv-transfer-config`` (a
    proper prefix of it, ``_`` as ``-``). Otherwise the last ``--kv-transfer-config`` under either spelling is
    vLLM's answer."""
    def abbrev(a: str) -> bool:
        name = a.partition("=")[0].partition(".")[0].replace("_", "-")
        return len(name) > 2 and name != KTC and KTC.startswith(name)
    return "--config" in argv or any(a.startswith("-") and ("." in a.partition("=")[0] or abbrev(a)) for a in argv)


def _names_ours(raw: str) -> bool:
    """Whether the ``--kv-transfer-config`` JSON ``raw`` names one of our connectors or tiers."""
    try:
        full = json.loads(raw)
    except ValueError:
        return False
    return isinstance(full, dict) and bool(_ours(full))


def _ours(ktc: dict) -> list[tuple[str, dict]]:
    """``("connector", kv_connector_extra_config)`` of each of our connectors and ``("tier", tier dict)`` of each
    of our secondary tiers in ``ktc`` (MultiConnector children included)."""
    out: list[tuple[str, dict]] = []
    extra = ktc.get("kv_connector_extra_config") or {}
    if ktc.get("kv_connector") == CONNECTOR:
        out.append(("connector", extra))
    if ktc.get("kv_connector") == "OffloadingConnector" and isinstance(extra, dict):
        for tier in extra.get("secondary_tiers") or []:
            if isinstance(tier, dict) and tier.get("module_path") == TIER_MODULE:
                out.append(("tier", tier))
    if ktc.get("kv_connector") == "MultiConnector" and isinstance(extra, dict):
        for child in extra.get("connectors", []) or []:
            if isinstance(child, dict):
                out += _ours(child)
    return out


def check_extra(extra: dict, *, create: bool = True, disagg: str | None = None,
                disagg_from: str = "--disaggregation-mode") -> None:
    """Raise :class:`~kvbm_backend.config.ConfigError` (field named) if the connector's
    ``kv_connector_extra_config`` cannot start. ``create=False``: write nothing (a dry run). ``disagg``: the
    worker's disaggregation mode when our connector hands off through G4 (prefill or decode: G4 required;
    prefill: ``save`` and ``save_to_g4`` on too); ``disagg_from``: where it was given (named in the error)."""
    from ..config import ConfigError
    from .vllm.extra_config import config_from_extra
    cfg, opts = config_from_extra(extra)
    _check_keyring(cfg, create)
    if disagg in ("prefill", "decode"):
        if not (cfg.g4.enabled and cfg.g4.url):
            raise ConfigError(f"g4.enabled: {_mode_text(disagg_from, disagg)} with KvbmBackendConnector alone hands the "
                              "prompt's KV off through G4, which is off here (G3 is private to one worker); enable G4 "
                              "on both workers (the same store and keyring), or run NixlConnector beside it")
        for k in ("save", "save_to_g4"):
            if disagg == "prefill" and not opts[k]:
                raise ConfigError(f"kv_connector_extra_config.{k}: {_mode_text(disagg_from, disagg)} hands the prompt's "
                                  f"KV off through G4, but {k} is false: the decode worker would find nothing")


def _mode_text(source: str, mode: str) -> str:
    """``--disaggregation-mode prefill`` or ``DYN_VLLM_DISAGGREGATION_MODE=prefill``: the mode as it was given."""
    return f"{source} {mode}" if source.startswith("--") else f"{source}={mode}"


def check_tier(tier: dict, *, create: bool = True) -> None:
    """The same for a ``G3Tier``/``G4Tier`` entry of ``secondary_tiers`` (its ``config``, ``g3``, ``g4`` keys); a
    G3Tier's keyring too when its config names one (it follows its revocations, :mod:`.vllm.tier_revoked`). A tier
    whose own section is off (``g3.enabled: false`` for a G3Tier, ``g4.enabled: false`` set for a G4Tier) is refused
    naming the field, as the tier refuses it (:func:`.vllm.extra_config.check_tier_section`; before 2026-12-01 both
    passed, and the tiers opened their pools anyway)."""
    from ..config import ConfigError
    from .vllm.extra_config import tier_config
    name = tier.get("type", "tier")
    try:  # the tier's own section on (g3.enabled / g4.enabled, g4.url), as the tier checks it when vLLM builds it
        cfg = tier_config(tier.get("config"), g3=tier.get("g3"), g4=tier.get("g4"),
                          tier={"G3Tier": "G3", "G4Tier": "G4"}.get(name))
        if name == "G4Tier":
            _check_keyring(cfg, create)
        elif name == "G3Tier" and cfg.g4.keyring.path:  # it follows that keyring's revocations (tier_revoked)
            _check_keyring(cfg.model_copy(update={"g4": cfg.g4.model_copy(update={"enabled": True, "encrypt": True})}),
                           create)
    except (ConfigError, ValueError) as e:
        raise ConfigError(f"secondary_tiers {name}: {e}") from None


def _check_keyring(cfg, create: bool) -> None:
    """The keyring a G4 pool of ``cfg`` opens, opened as it opens it: with ``g4.encrypt``, and with
    ``g4.keyring.path`` set when it is false too (a plaintext pool with a keyring names tenants and opens encrypted
    blocks with it, and does not start when it does not open: ``G4Pool``; before 2026-12-03 only ``g4.encrypt:
    true`` was checked). A dry run's missing keyring is left to the engine, but the KEK it would be created with
    (``$kek_env``, else an existing KEK file) must open; a ``kek_env`` the config names must be set
    (:func:`kvbm_backend.crypto.kek.check_kek_env`). A relative ``g4.keyring.path`` / ``kek_file`` while the working
    directory has been removed names no file: refused naming the field, dry run too, as ``config effective`` refuses
    it (:func:`kvbm_backend.apps.effective.check_keyring_paths`; before 2026-12-03 a dry run passed it, exit 0).
    Raises ConfigError naming ``g4.keyring`` and the file or variable at fault."""
    from ..config import ConfigError
    g4 = cfg.g4
    if not (g4.enabled and (g4.encrypt or g4.keyring.path)):
        return
    from ..crypto.keyring import Keyring, KeyringError, provider_for
    from ..crypto.kek import check_kek_env
    from ..fsmodes import unresolvable
    kc = g4.keyring  # '~' is $HOME, as Keyring.from_config reads it (docs/configuration.md g4.keyring.path)
    kc = kc.model_copy(update={"path": kc.path and os.path.expanduser(kc.path),
                               "kek_file": kc.kek_file and os.path.expanduser(kc.kek_file)})
    bad = unresolvable((("g4.keyring.path", kc.path), ("g4.keyring.kek_file", kc.kek_file)))
    if bad:
        raise ConfigError(bad)
    try:
        check_kek_env(kc)  # a non-default kek_env unset: refused, dry run too (before 2026-12-03: a new KEK file)
        if not create and kc.path and not os.path.exists(kc.path):
            # the engine would create it (and a KEK file): a dry run leaves that to it, not the KEK it would use
            if os.environ.get(kc.kek_env) or os.path.lexists(kc.kek_file or f"{kc.path}.kek"):
                provider_for(kc.path, kc.kek_env, kc.kek_file, create=False)
            return
        Keyring.from_config(kc, create=create).close()
    except (KeyringError, OSError) as e:
        msg = str(e)
        why = "" if g4.encrypt else (" (g4.encrypt is false, but a G4 pool opens the keyring g4.keyring.path names: "
                                     "it names tenants and opens encrypted blocks with it)")
        raise ConfigError((msg if msg.startswith("g4.") else f"g4.keyring: {msg}") + why) from None


def check_argv(argv: list[str], *, create: bool = True) -> str | None:
    """The first problem of the kvbm-backend connectors and tiers in ``--kv-transfer-config`` as one line, or
    None (also None when there is no such argument or nothing of ours). ``create=False``: write nothing.
    The config checked is the one vLLM uses: the last ``--kv-transfer-config`` (``--kv_transfer_config``,
    ``=V`` or ``V``) after vLLM's own parsing (:func:`_vllm_values`: ``--config FILE.yaml``, dotted
    ``--kv-transfer-config.KEY``, an abbreviated name such as ``--kv-transfer-conf``). Arguments vLLM cannot read
    (a ``--config`` it cannot open, an ambiguous abbreviation) are reported as a problem (the engine would not
    start either), not passed unchecked. Before 2026-11-30 ``--config``, dotted options and abbreviations went
    unseen."""
    values: list[str] | None = None
    if _needs_vllm(argv):
        try:
            values = _vllm_values(argv)
        except ImportError as e:
            return f"--config / dotted / abbreviated options: vLLM's argument parser cannot be imported ({e}); not checked"
        except Exception as e:  # noqa: BLE001 - vLLM refuses these arguments too: one line, not a pass
            where = f"--config {argv[argv.index('--config') + 1]}" if "--config" in argv[:-1] else "arguments"
            return (f"{where}: vLLM cannot read its arguments ({type(e).__name__}: {e}); "
                    "the --kv-transfer-config it would use is not known, so it is not checked")
    raw = _arg(argv, KTC) if values is None else (values[-1] if values else None)
    if raw is None:
        return None
    try:
        ktc = json.loads(raw)
    except ValueError as e:
        return f"--kv-transfer-config: not JSON ({e})"
    if not isinstance(ktc, dict):
        return "--kv-transfer-config: expected a JSON object"
    if "kv_connector" not in ktc and values and len(values) > 1 and _names_ours(values[-2]):
        return ("--kv-transfer-config: vLLM merges the dotted --kv-transfer-config.KEY options into one JSON given "
                "after the full one, which it replaces; that JSON names no kv_connector, so KvbmBackendConnector "
                "would not run: give every key dotted (kv_connector too) or all of them in the JSON")
    mode, mode_from = _arg(argv, "--disaggregation-mode"), "--disaggregation-mode"
    if mode is None and os.environ.get(MODE_ENV):  # dynamo.vllm takes the variable where the flag is absent
        mode, mode_from = os.environ[MODE_ENV], MODE_ENV
    alone = ktc.get("kv_connector") == CONNECTOR  # the G4 handoff's form (a MultiConnector's transport does PD)
    for kind, d in _ours(ktc):
        try:
            if kind == "connector":
                check_extra(d, create=create, disagg=mode if alone else None, disagg_from=mode_from)
            else:
                check_tier(d, create=create)
        except Exception as e:  # noqa: BLE001 - ConfigError / ValueError: one line for the operator
            return f"kv_connector_extra_config: {e}" if not str(e).startswith("kv_connector_extra_config") else str(e)
    return None


def exit_if_bad(argv: list[str] | None = None) -> None:
    """:func:`check_argv` on ``sys.argv``; print ``kvbm-backend: error: ...`` and exit 2 on a problem."""
    why = check_argv(sys.argv[1:] if argv is None else argv)
    if why:
        print(f"kvbm-backend: error: {why}", file=sys.stderr)
        raise SystemExit(2)
