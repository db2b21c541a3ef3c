"""Ansible filters that check what the roles write into environment, config and unit files (the
``sparkspec_sd_*`` filters among them): each problem is one line naming the variable and the fix.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from typing import Any

from ansible.errors import AnsibleFilterError

from sparkspec import argtypes, systemd
from sparkspec.errors import UserError
from sparkspec.registry import SECRET_OPTIONS

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
UNIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}")
# systemd's unit types (systemd.unit(5)): a name ending in one is another unit's name
UNIT_TYPES = (".service", ".socket", ".device", ".mount", ".automount", ".swap", ".target", ".path",
              ".timer", ".slice", ".scope")
USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
REDACTED = "<redacted>"
# vLLM flags whose value is a secret: on the command line it would show in every process list (their
# one list, read in vLLM's argument parser: sparkspec.registry.data.SECRET_OPTIONS).
SECRET_FLAGS = SECRET_OPTIONS


def name_problems(unit_name: Any, user: Any) -> list[str]:
    """The unit's and the service user's names, which become file names and paths."""
    out = []
    if not (isinstance(unit_name, str) and UNIT_NAME.fullmatch(unit_name)):
        out.append(f"sparkspec_unit_name {unit_name!r} is not a unit name (letters, digits, "
                   "'_.@-'); fix it")
    elif unit_name.endswith(UNIT_TYPES):
        # the role adds .service: vllm.service would be vllm.service.service, and the guard and the
        # watchdog (which take the name as systemctl does) would act on another unit
        out.append(f"sparkspec_unit_name {unit_name!r} ends in a unit type; give the name without "
                   f"it, e.g. {unit_name.rsplit('.', 1)[0]!r}")
    if not (isinstance(user, str) and USER_NAME.fullmatch(user)):
        out.append(f"sparkspec_user {user!r} is not a system user name (lowercase letters, digits, "
                   "'_-'); fix it")
    return out


def _problem(check: Callable[..., Any], *args: Any) -> list[str]:
    """[] when ``check(*args)`` passes, else its one line."""
    try:
        check(*args)
    except UserError as exc:
        return [str(exc)]
    return []


def env_problems(env: Any, var: str = "deploy_env") -> list[str]:
    """Variable names and values of an environment map that systemd's environment file can carry
    exactly (sparkspec.systemd.env_name and env_value)."""
    if not isinstance(env, Mapping):
        return [f"{var} is a {type(env).__name__}, not a mapping of NAME: value; fix it"]
    out = []
    for name, value in env.items():
        out += (_problem(systemd.env_name, name, var)
                or _problem(systemd.env_value, value, f"{var}.{name}"))
    return out


def pip_env_problems(env: Any) -> list[str]:
    """sparkspec_pip_env: only PIP_* options (for pip's 0600 config file, never the environment)."""
    out = env_problems(env, "sparkspec_pip_env")
    if isinstance(env, Mapping):
        out += [f"sparkspec_pip_env: {name!r} is not a PIP_* option; pip reads only those from its "
                "config file (an environment variable shows in the process list); e.g. a proxy is "
                "PIP_PROXY"
                for name in env if isinstance(name, str) and not name.startswith("PIP_")]
    return out


def args_problems(args: Any) -> list[str]:
    """vLLM's command line: no secret flag (it would show in every process list), no control
    character (it would end the unit's ExecStart line and start another directive)."""
    out = []
    for arg in args if isinstance(args, list) else []:
        text = str(arg)
        flag = text.split("=", 1)[0]
        if flag in SECRET_FLAGS:
            out.append(f"serve.extra_args: {flag} puts a secret on vLLM's command line, where "
                       "every process list shows it; remove "
                       f"it{' and set sparkspec_api_key' if flag == '--api-key' else ''}")
        elif any(ord(c) < 32 or ord(c) == 127 for c in text):
            out.append(f"vLLM argument {text!r} holds a control character (a newline would start "
                       "another line of the unit); fix serve.extra_args (sparkspec_serve, the "
                       "profile's or the method's) or the profile's served_model_name")
    return out


def _raise_first(problems: list[str]) -> None:
    if problems:
        raise AnsibleFilterError(problems[0])


def _filter(quote: Callable[..., str]) -> Callable[..., str]:
    """A sparkspec.systemd quoting function as a filter: its UserError is the filter's
    error (one line)."""
    def run(value: Any, *args: Any) -> str:
        try:
            return quote(value, *args)
        except UserError as exc:
            raise AnsibleFilterError(str(exc)) from None
    run.__doc__ = quote.__doc__
    return run


env_quote = _filter(systemd.env_value)
# What each kind of check in sd_problems runs (sparkspec.systemd);
# setting_value's kinds as setting:KIND.
SD_CHECKS: dict[str, Callable[..., str]] = {
    "word": systemd.word, "executable": systemd.executable, "path": systemd.path_list_item,
    "single_path": systemd.path, "text": systemd.text, "comment": systemd.comment,
    "line": systemd.unit_line, "env_name": systemd.env_name, "env_value": systemd.env_value,
    **{f"setting:{kind}": (lambda v, n, k=kind: systemd.setting_value(v, k, n))
       for kind in systemd.SETTINGS},
}


def sd_problems(checks: Any) -> list[str]:
    """The first line of what systemd could not carry exactly, over [kind, name, value] checks (kind
    a key of SD_CHECKS; a name ending in [] takes a list and checks each item, named name[i]; one
    ending in ? may be null or empty)."""
    for kind, name, value in checks:
        if name.endswith("?"):
            items = [] if value in (None, "") else [(name[:-1], value)]
        elif name.endswith("[]"):
            if not isinstance(value, list):
                return [f"{name[:-2]} is a {type(value).__name__}, not a list; fix it"]
            items = [(f"{name[:-2]}[{i}]", item) for i, item in enumerate(value)]
        else:
            items = [(name, value)]
        for item_name, item in items:
            if problems := _problem(SD_CHECKS[kind], item, item_name):
                return problems
    return []


def _bounds() -> dict[str, tuple[type[int | float], float, float, bool]]:
    """The number kinds the memory guard and the watchdog take: (type, low, high, low_open), from
    the commands' own limits (sparkspec.operate), so a value the deploy lets through is one they
    accept."""
    from sparkspec.operate import memfit, watchdog
    return {"seconds": (float, 0.0, watchdog.MAX_SECONDS, True),
            "count": (int, 1, watchdog.MAX_COUNT, False),
            "gib": (float, 0.0, memfit.MAX_MARGIN_GIB, False)}


def number_problems(checks: Any) -> list[str]:
    """Numbers that land in a unit's command line or a service's config: each check is [variable,
    value, kind ('seconds', 'count' or 'gib'), nullable]; a bool, a non-number, NaN/inf or a value
    outside the kind's bounds is one line naming the variable (argtypes.number's rule, the one every
    sparkspec command uses, with the bounds of the command the value reaches)."""
    bounds = _bounds()
    out = []
    for var, value, kind, nullable in checks:
        if value is None and nullable:
            continue
        typ, low, high, low_open = bounds[kind]
        try:
            if isinstance(value, bool) or not isinstance(value, int | float | str):
                raise argparse.ArgumentTypeError(f"{value!r} is not a number")
            argtypes.number(typ, low, high, low_open=low_open)(str(value))
        except argparse.ArgumentTypeError as exc:
            what = "a whole number" if typ is int else "a number"
            null = " or null" if nullable else ""
            bound = f"{'>' if low_open else '>='} {low:g} and <= {high:.10g}"
            out.append(f"{var}: {exc}; give {what} {bound}{null}")
    return out


def is_secret_name(name: Any) -> bool:
    """True for names that hold secrets by convention (*KEY*, *TOKEN*, *SECRET*, *PASSWORD*...)."""
    return bool(SECRET_NAME.search(str(name)))


def redact_env(env: Mapping[str, Any], redact: bool = True) -> dict[str, Any]:
    """The map with secret-named variables' values replaced by <redacted> (when ``redact``)."""
    return {k: (REDACTED if redact and is_secret_name(k) else v) for k, v in env.items()}


def pip_config(env: Mapping[str, Any]) -> str:
    """pip's config file holding the PIP_* options of ``env`` exactly as pip would read them from
    the environment ([global] section, PIP_FOO_BAR -> foo-bar; pip reads it without
    interpolation)."""
    _raise_first(pip_env_problems(env))
    lines = ["# Written by sparkspec (sparkspec_pip_env); readable by root only: it may hold index "
             "credentials.",
             "[global]"]
    lines += [f"{name[4:].lower().replace('_', '-')} = {value}"
              for name, value in sorted(env.items())]
    return "\n".join(lines) + "\n"


class FilterModule:
    def filters(self) -> dict[str, Callable[..., Any]]:
        return {
            "sparkspec_name_problems": name_problems,
            "sparkspec_env_problems": env_problems,
            "sparkspec_pip_env_problems": pip_env_problems,
            "sparkspec_args_problems": args_problems,
            "sparkspec_env_quote": env_quote,
            "sparkspec_sd_word": _filter(systemd.word),
            "sparkspec_sd_executable": _filter(systemd.executable),
            "sparkspec_sd_path": _filter(systemd.path_list_item),
            "sparkspec_sd_single_path": _filter(systemd.path),
            "sparkspec_sd_text": _filter(systemd.text),
            "sparkspec_sd_comment": _filter(systemd.comment),
            "sparkspec_sd_setting": _filter(systemd.setting_value),
            "sparkspec_sd_line": _filter(systemd.unit_line),
            "sparkspec_sd_env_name": _filter(systemd.env_name),
            "sparkspec_sd_problems": sd_problems,
            "sparkspec_number_problems": number_problems,
            "sparkspec_is_secret_name": is_secret_name,
            "sparkspec_redact_env": redact_env,
            "sparkspec_pip_config": pip_config,
        }
