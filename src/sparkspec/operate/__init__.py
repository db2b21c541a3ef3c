"""Operating a deployed unit unattended: the memory fit guard and its measurement (:mod:`.memfit`),
and the watchdog that restarts a stuck engine (:mod:`.watchdog`, :mod:`.watchrun`). Both read vLLM's
/metrics through :mod:`sparkspec.bench.metrics` (:mod:`.scrape` adds the gauges and info labels it
does not keep) and ask systemd through ``systemctl``, whose path tests replace on PATH or by an
injected callable."""
