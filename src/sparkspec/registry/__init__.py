"""The registry of methods and profiles: the only schema, the one home of
their values, and everything a host needs resolved once (:func:`resolve`),
with vLLM's command line built from it (:func:`vllm_command`).
"""

from sparkspec.registry.command import BASE_ENV, vllm_command
from sparkspec.registry.data import (
    BUILTIN_METHODS,
    CLUSTER_DEFAULTS,
    CONTRACT_KEYS,
    DFLASH_BACKENDS,
    DFLASH_REVISIONS,
    HEAD_KINDS,
    KNOBS,
    LEVERS,
    LEVERS_ENV,
    NAMES,
    RENAMED,
    SECRET_OPTIONS,
    SECRET_PREFIX_OPTIONS,
    SERVE,
    SERVE_DEFAULTS,
    SERVE_FLAGS,
    SERVE_KINDS,
    VERIFY_DEFAULTS,
    VERIFY_KEYS,
)
from sparkspec.registry.fields import secret_option
from sparkspec.registry.levers import check_levers
from sparkspec.registry.resolve import (
    check_renamed,
    choose_method,
    defined_methods,
    downloads,
    lookup_profile,
    resolve,
)
from sparkspec.registry.schema import (
    KINDS,
    METHOD_KEYS,
    PROFILE_KEYS,
    SPEC_FIELDS,
    SPEC_INTERNAL,
    RegistryError,
    check_contract,
    check_method,
    check_profile,
    check_serve,
    check_verify,
    repo_folder,
)

__all__ = ["BASE_ENV", "BUILTIN_METHODS", "CLUSTER_DEFAULTS", "CONTRACT_KEYS", "DFLASH_BACKENDS",
           "DFLASH_REVISIONS", "HEAD_KINDS", "KINDS",
           "KNOBS", "LEVERS", "LEVERS_ENV", "METHOD_KEYS", "NAMES", "PROFILE_KEYS", "RENAMED",
           "SECRET_OPTIONS", "SECRET_PREFIX_OPTIONS", "SERVE", "SERVE_DEFAULTS", "SERVE_FLAGS",
           "SERVE_KINDS", "SPEC_FIELDS", "SPEC_INTERNAL", "VERIFY_DEFAULTS", "VERIFY_KEYS",
           "RegistryError", "check_contract", "check_levers", "check_method", "check_profile",
           "check_renamed", "check_serve", "check_verify", "choose_method", "defined_methods",
           "downloads", "lookup_profile", "repo_folder", "resolve", "secret_option", "vllm_command"]
