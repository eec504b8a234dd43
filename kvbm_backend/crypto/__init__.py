"""Per-tenant encryption for G4: AES-256-GCM sealing (:mod:`.aead`) and the wrapped-key keyring (:mod:`.keyring`)."""
from .aead import AeadError, open_into, seal_into
from .keyring import DataKey, KeyProvider, Keyring, KeyringError, LocalKek, provider_for

__all__ = ["AeadError", "open_into", "seal_into", "DataKey", "KeyProvider", "Keyring", "KeyringError", "LocalKek",
           "provider_for"]
