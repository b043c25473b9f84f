"""The daemon's Prometheus metrics (prometheus_client), served on `--http-port` at /metrics.

Counters and histograms are updated where things happen (the servicer); what the store holds
(bytes per model and version, leases, sessions) is read from it at scrape time, so it is never
out of date."""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class DaemonMetrics:
    def __init__(self, server, started_at: float) -> None:
        self.registry = CollectorRegistry()
        self.started_at = started_at
        self.loads = Counter("preload_daemon_loads", "Loads and publishes, by outcome", ["outcome"],
                             registry=self.registry)
        self.load_seconds = Histogram("preload_daemon_load_seconds", "Seconds per successful load or publish",
                                      buckets=LOAD_BUCKETS, registry=self.registry)
        self.attaches = Counter("preload_daemon_attaches", "Attach calls that returned a lease",
                                registry=self.registry)
        self.attach_seconds = Histogram("preload_daemon_attach_seconds", "Seconds per successful Attach call",
                                        buckets=LATENCY_BUCKETS, registry=self.registry)
        self.errors = Counter("preload_daemon_errors", "RPCs that failed, by error kind", ["kind"],
                              registry=self.registry)
        self.registry.register(_StoreCollector(server, self.started_at))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _StoreCollector:
    """Gauges read from the live store and servers at scrape time."""

    def __init__(self, server, started_at: float):
        self.server = server
        self.started_at = started_at

    def collect(self):
        store, sessions = self.server.store, self.server.sessions
        resident = GaugeMetricFamily("preload_daemon_resident_bytes", "Slab bytes held, per model and version",
                                     labels=["model", "version"])
        leases = GaugeMetricFamily("preload_daemon_leases", "Active leases, per model and version",
                                   labels=["model", "version"])
        for name, number, held, leased in store.usage():
            resident.add_metric([name, str(number)], held)
            leases.add_metric([name, str(number)], leased)
        yield resident
        yield leases
        ended = CounterMetricFamily("preload_daemon_leases_ended", "Leases that ended, by how (released, "
                                    "session: the process exited, reaped, evicted)", labels=["how"])
        for how, count in sorted(store.leases.ended.items()):
            ended.add_metric([how], count)
        yield ended
        yield GaugeMetricFamily("preload_daemon_sessions", "Open sessions (attached processes)", value=len(sessions))
        yield GaugeMetricFamily("preload_daemon_sessions_refused", "Sessions refused since start (cap, uid)",
                                value=sessions.refused)
        yield GaugeMetricFamily("preload_daemon_serving", "1 once models are loaded and no load is in flight",
                                value=int(self.server.ready()))
        yield GaugeMetricFamily("preload_daemon_adopted_bytes", "Slab bytes adopted from a previous daemon at start",
                                value=store.adopted_bytes)
        yield GaugeMetricFamily("preload_daemon_adoption_seconds", "Seconds spent adopting slabs at start",
                                value=store.adoption_seconds)
        if self.server.serving_since:
            yield GaugeMetricFamily("preload_daemon_start_to_serving_seconds",
                                    "Daemon start to its first SERVING health state",
                                    value=self.server.serving_since - self.started_at)
