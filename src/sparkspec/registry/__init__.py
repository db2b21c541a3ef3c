"""The registry of methods and profiles: the only schema, the one home of their values, and everything a host
needs resolved once.

The roles call it through the sparkspec role's filter plugin (roles/sparkspec/filter_plugins): the contract
role sets one fact per host, ``sparkspec_resolved``, from :func:`resolve`, and every role reads folders,
profile values, heads, the venv, the serve knobs, the verify floors and the speculative config from it; the
deploy role turns it into vLLM's command line with :func:`vllm_command`. Each error is one line naming the
inventory key and the fix.

- :mod:`.data`: the built-in methods, the serve defaults and verify floors, and the names other places use
  (head kinds, contract keys, serve knob names, renamed keys);
- :mod:`.schema`: the shape of methods, profiles, serve and verify blocks and the contract itself;
- :mod:`.fields`: their typed values (names, folders, serve knob values, speculative config values, port and
  address) and vLLM's secret options;
- :mod:`.resolve`: the switch rule, the merge order, the downloads;
- :mod:`.levers`: the levers blocks, merged, and what the vLLM release and the model's head must be;
- :mod:`.command`: vLLM's argv, the unit's environment and record;
- :mod:`.cluster`: a cluster's layout and each node's place in it (rank, arguments, link environment).
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
