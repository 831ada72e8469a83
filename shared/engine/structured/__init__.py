"""Structured outputs in the engine: a request's ``SamplingParams.structured_outputs`` (JSON schema,
any JSON object, regex, choice or EBNF grammar) compiled against the model's tokenizer with xgrammar
(chosen by measurement: bench/grammar_backends.py, BENCHMARKS.md), one matcher per sequence, and a token
bitmask per step for the rows that carry one, applied in the sampler.

- backend.py: the xgrammar binding: tokenizer info, compiler, a constraint's compile (errors name the field);
- json_strings.py: length-bounded strings of a schema as patterns (xgrammar's own let control characters in);
- compile_cache.py: compiles off the step loop in a thread pool, an LRU of results per constraint text;
- matcher.py: one sequence's grammar state, advanced over the tokens it has generated;
- bitmask.py: the batch's mask on the host and its application to the logits on the device;
- utf8.py: which tokens keep the output valid UTF-8 after its last partial character (xgrammar lets some
  invalid sequences through);
- manager.py: what the engine core and the model runner call.
"""
