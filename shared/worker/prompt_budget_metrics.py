"""A decoding worker's view of its prompt-token budget while requests decode (shared/engine/token_budget.py), read
at scrape time: the cap the last step with decodes had (the fixed --max-prefill-tokens-with-decodes, or what
--target-step-ms left), and under a target the step-cost fit it follows (shared/engine/step_cost.py), so a run
shows what the engine learnt of its own steps next to the inter-token latency it got."""

from prometheus_client.core import GaugeMetricFamily

TERMS = ("fixed", "per_decode_row", "per_context_token", "per_prompt_token")


class PromptBudgetCollector:
    def __init__(self, core, model_name: str):
        self.core = core
        self.model = model_name

    def collect(self):
        cap, coefficients = self.core.prompt_budget()
        family = GaugeMetricFamily("kvrelay_prefill_tokens_cap", "Prompt tokens the last step that had decodes could "
                                   "take beside them (0 before any did)", labels=["model_name"])
        family.add_metric([self.model], cap or 0)
        yield family
        if coefficients is not None:
            family = GaugeMetricFamily("kvrelay_step_cost_seconds", "The --target-step-ms fit of this engine's step "
                                       "time: seconds fixed, per decode row, per decode context token, per prompt "
                                       "token", labels=["model_name", "term"])
            for term, value in zip(TERMS, coefficients, strict=True):
                family.add_metric([self.model, term], value)
            yield family
