"""The engine's Prometheus metrics (prometheus_client), read from its state at scrape time: whether
it is ready or degraded, how long its weights and its start took, how often it re-attached to a new
daemon, its request counters and its speculation gauges. prometheus_client is imported at the
first scrape, not at the engine's start."""

SPECULATION = ("acceptance_rate", "mean_accepted_length", "tokens_per_main_forward")


class _EngineCollector:
    def __init__(self, state):
        self.state = state

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        state = self.state
        names, values = ["model", "replica"], [state.name, str(state.replica)]

        def family(kind, name: str, doc: str, value: float, extra: dict | None = None):
            metric = kind(name, doc, labels=names + list(extra or {}))
            metric.add_metric(values + list((extra or {}).values()), value)
            return metric

        yield family(GaugeMetricFamily, "preload_engine_ready", "1 when the engine serves requests", state.is_ready())
        yield family(GaugeMetricFamily, "preload_engine_degraded", "1 while the engine serves without its daemon",
                     bool(state.degraded()))
        yield family(CounterMetricFamily, "preload_engine_reattached", "Leases taken again from a new daemon",
                     sum(k.reattached for k in state.keepers))
        if "weights_done" in state.timings:
            timings, fmt = state.timings, {"load_format": state.weights.load_format}
            yield family(GaugeMetricFamily, "preload_engine_weights_seconds", "Seconds of the weights phase",
                         timings["weights_done"] - timings["weights_start"], fmt)
            yield family(GaugeMetricFamily, "preload_engine_start_to_ready_seconds", "Process start to ready",
                         timings["ready"] - timings["process_start"], fmt)
        engine = state.engine
        for key, value in (engine.stats if engine else {}).items():
            yield family(CounterMetricFamily, f"preload_engine_{key}", STATS_HELP.get(key, key.replace("_", " ")),
                         value)
        speculation = engine.speculation() if engine else {}
        for key in SPECULATION:
            if key in speculation:
                yield family(GaugeMetricFamily, f"preload_engine_spec_{key}", f"Speculative decoding: {key}",
                             speculation[key])


STATS_HELP = {  # what each of the engine's counters counts (HTTP requests are not: one may hold many choices)
    "requests": "Choices prefilled: every prompt's n choices, of every HTTP request (those refused never start)",
    "prompt_tokens": "Prompt tokens prefilled",
    "generated_tokens": "Tokens generated: end-of-sequence tokens and those past a stop string included, which a "
                        "response's usage does not count",
    "decode_steps": "Decode steps: forwards of the main model over every running choice",
    "prefill_parts": "Parts of long prompts prefilled between decode steps (--prefill-chunk)",
    "spec_proposed": "Speculative decoding: draft tokens proposed",
    "spec_accepted": "Speculative decoding: draft tokens the main model accepted",
    "spec_verified": "Speculative decoding: verifications by the main model, a choice each",
    "spec_emitted": "Speculative decoding: tokens its steps emitted",
}


def metrics_text(state) -> str:
    from prometheus_client import CollectorRegistry, generate_latest
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(state))
    return generate_latest(registry).decode()
