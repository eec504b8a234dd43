"""What the G4 operator log says about a tenant's offload the keyring refused (:func:`keyring_drop_text`, used by
:meth:`~.writer.G4Writer._drop_text`)."""
from __future__ import annotations

from typing import Any

from ...crypto.names import MAX_AUTO_TENANT_BYTES
from ...model.namespace import tenant_bytes

__all__ = ["keyring_drop_text"]


def keyring_drop_text(kr: Any, default_tenant: str, reason: str, tenant: str | None = None) -> str:
    """The log text of an offload dropped for ``reason`` (a keyring refusal) by keyring ``kr``: a fixed text with the
    keyring's settings, nothing of the tenant (its pseudonym is logged beside it).

    The rule: a log line never holds a tenant id, not even the configured default one (a request's tenant is
    its client's cache_salt; the configured value may be one too, and logs travel further than the config).
    Two tenants are named all the same, without their id: the configured default (``default_tenant``, the
    ``tenant`` setting) as "the default tenant (`tenant`)", with a ``keys create`` command that takes the
    value from the config; and the empty tenant ``""`` (it has no id to hide), with ``--tenant ''``.
    """
    where = f"keyring {getattr(kr, 'path', '?')}"
    if reason == "dropped_revoked_tenant":
        return f"{where}: the tenant was revoked; only `kvbm-backend keys create` brings it back"
    if reason == "dropped_unknown_tenant":
        why = ("it is read-only" if getattr(kr, "read_only", False) else
               "g4.keyring.auto_create_tenants is off" if not getattr(kr, "auto_create_tenants", True) else
               f"the tenant id is over {MAX_AUTO_TENANT_BYTES} bytes (never created implicitly)"
               if tenant is not None and len(tenant_bytes(tenant)) > MAX_AUTO_TENANT_BYTES else
               f"it holds g4.keyring.max_auto_tenants={getattr(kr, 'max_auto_tenants', '?')} tenants")
        create = f"kvbm-backend keys create --keyring {getattr(kr, 'path', 'KEYRING')} --tenant"
        default = "every request without a cache_salt has it"
        if tenant == default_tenant == "":
            return (f"{where}: no data key for the empty tenant \"\" (the default `tenant`: {default}) and "
                    f"{why}; create it with `{create} ''`, or set `tenant:` in the config")
        if tenant == default_tenant:
            return (f"{where}: no data key for the configured default tenant (the value of `tenant`, not "
                    f"logged: {default}) and {why}; create it with `{create} <the configured tenant>`")
        if tenant == "":
            return (f"{where}: no data key for the empty tenant \"\" (not the default `tenant`: a request "
                    f"named it) and {why}; create it with `{create} ''`")
        return f"{where}: no data key for the tenant and {why}; create it with `kvbm-backend keys create`"
    return (f"{where}: no data key served (the file does not load or cannot be written, or a read-only key "
            "version reached its use limit): see the keyring's own log line, `kvbm-backend doctor`")
