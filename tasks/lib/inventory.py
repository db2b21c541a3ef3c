"""The project's inventories, read in-process through Ansible's inventory API (hosts, templated host
variables, vault-decrypted where a vault password file is configured), with the contract's defaults
underneath."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from sparkspec.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
# Ansible reads its configuration once, at import: it must be the project's (roles path, callbacks,
# vault).
os.environ["ANSIBLE_CONFIG"] = str(ROOT / "ansible.cfg")

# E402: these imports must follow the ANSIBLE_CONFIG line above (Ansible reads its configuration at
# import)
from ansible import constants as C  # noqa: E402
from ansible.errors import AnsibleError  # noqa: E402
from ansible.inventory.manager import InventoryManager  # noqa: E402
from ansible.parsing.dataloader import DataLoader  # noqa: E402
from ansible.plugins.loader import init_plugin_loader  # noqa: E402
from ansible.template import Templar  # noqa: E402
from ansible.vars.manager import VariableManager  # noqa: E402

CONTRACT_DEFAULTS = ROOT / "roles/sparkspec/defaults/main.yml"


def inventory_path(inventory: str | os.PathLike[str]) -> Path:
    """The inventory folder or file, relative to the current folder or else to the project."""
    path = Path(inventory)
    if not path.is_absolute():
        path = path.resolve() if path.exists() else ROOT / path
    if not path.exists():
        raise UserError(f"{inventory}: inventory not found; pass --inventory inventories/<site>")
    return path


@dataclass(frozen=True)
class Inventory:
    path: Path
    loader: DataLoader
    manager: InventoryManager
    variables: VariableManager

    @property
    def hosts(self) -> list[str]:
        return sorted(h.name for h in self.manager.get_hosts())

    def hosts_of(self, pattern: str) -> list[str]:
        """The hosts a --host value names: one host, a group (a cluster's: its members, in order) or
        a comma-separated list of either; one line naming the hosts and groups when a name is
        neither."""
        out: list[str] = []
        for name in [n.strip() for n in pattern.split(",")]:
            if self.manager.get_host(name) is not None:
                found = [name]
            elif name in self.manager.groups and name not in ("all", "ungrouped"):
                found = [h.name for h in self.manager.groups[name].get_hosts()]
            else:
                groups = ", ".join(sorted(g for g in self.manager.groups
                                          if g not in ("all", "ungrouped")))
                raise UserError(f"host {name!r} is not in inventory {self.path} (hosts: "
                                f"{', '.join(self.hosts) or 'none'}; groups: {groups or 'none'}); "
                                "add it there or pass --inventory")
            out += [h for h in found if h not in out]
        return out

    def require_host(self, host: str) -> None:
        if self.manager.get_host(host) is None:
            known = ", ".join(self.hosts) or "none"
            raise UserError(f"host {host!r} is not in inventory {self.path} (hosts: {known}); "
                            f"add it there or pass --inventory")

    def select(self, pattern: str) -> list[str]:
        """The hosts a pattern names: 'all' (the Sparks: the playbooks' group), or hosts and groups
        as :meth:`hosts_of` reads them."""
        if pattern == "all":
            return sorted(h.name for h in self.manager.get_hosts(pattern="sparks"))
        return self.hosts_of(pattern)

    def host_vars(self, host: str, names: tuple[str, ...]) -> dict[str, Any]:
        """The named variables of a host, templated as a play would see them (contract defaults
        underneath); a name set nowhere is left out."""
        self.require_host(host)
        hostvars = self.variables.get_vars(host=self.manager.get_host(host), include_hostvars=False)
        context = {**contract_defaults(self.loader), **hostvars}
        templar = Templar(loader=self.loader, variables=context)
        values: dict[str, Any] = {}
        for name in names:
            if name not in context:
                continue
            try:
                values[name] = templar.template(context[name])
            except AnsibleError as exc:
                first = " ".join(str(getattr(exc, "message", exc)).split())
                if "vault" in first.lower() or "undecryptable" in first:
                    raise UserError(f"{self.path}: {name} of host {host} is vault-encrypted and "
                                    "cannot be decrypted; set ANSIBLE_VAULT_PASSWORD_FILE to the "
                                    "vault's password file") \
                        from None
                raise UserError(f"{self.path}: cannot read {name} of host {host}: "
                                f"{first}") from None
        return values


def load(inventory: str | os.PathLike[str]) -> Inventory:
    """The inventory, parsed once per process; an inventory that does not parse is one line."""
    return _load(inventory_path(inventory))


@cache
def _plugins() -> None:
    # lookups and filters of the inventory's templates (once: it warns on a second call)
    init_plugin_loader()


@cache
def _load(path: Path) -> Inventory:
    _plugins()
    loader = DataLoader()
    _vault_secrets(loader)
    try:
        manager = InventoryManager(loader=loader, sources=[str(path)])
    except AnsibleError as exc:
        raise UserError(f"{path}: the inventory does not parse: "
                        f"{' '.join(str(exc).split())}") from None
    return Inventory(path, loader, manager, VariableManager(loader=loader, inventory=manager))


def contract_defaults(loader: DataLoader | None = None) -> dict[str, Any]:
    """The sparkspec contract's defaults (the lowest-precedence values each sparkspec role sees)."""
    # trusted as templates, as Ansible trusts a role's defaults: "{{ sparkspec_models_dir }}/heads"
    # is templated
    data = (loader or DataLoader()).load_from_file(str(CONTRACT_DEFAULTS), trusted_as_template=True)
    return dict(data or {})


def _vault_secrets(loader: DataLoader) -> None:
    """Decrypt vaulted variables (a sudo password, say) with the vault password file Ansible is
    configured with; without one, a vaulted value read here is an error naming it."""
    files = [C.DEFAULT_VAULT_PASSWORD_FILE] if C.DEFAULT_VAULT_PASSWORD_FILE else []
    if not files and not C.DEFAULT_VAULT_IDENTITY_LIST:
        return
    from ansible.cli import CLI

    try:
        secrets = CLI.setup_vault_secrets(loader, vault_ids=C.DEFAULT_VAULT_IDENTITY_LIST,
                                          vault_password_files=files, auto_prompt=False)
    except AnsibleError as exc:
        raise UserError(f"vault password file: {' '.join(str(exc).split())}; check "
                        "ANSIBLE_VAULT_PASSWORD_FILE") from None
    loader.set_vault_secrets(secrets)
