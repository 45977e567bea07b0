"""vLLM's wing: everything draftsmith does by driving a vLLM engine, which lives in its own
virtual environment (scripts/setup_vllm.sh, or DRAFTSMITH_VLLM_PYTHON).

    env.py        where vLLM's Python is, the environment a runner gets, running runners side by side
    capture.py    capture through vLLM (extract_hidden_states + draftsmith's KV connector)
    regenerate.py regeneration through vLLM (continuous batching, resumable)
    online.py     the vLLM producer of online training: vLLM serving the target in its own
                  processes and devices, streaming states to the trainer through Ray
    servable.py   whether the installed (or a recorded) vLLM serves a method's drafts for a target
    checks.py     the proofs: generation with a draft and vLLM's counters; vLLM's draft classes
                  built from an export and run piece by piece
    runners/      the scripts vLLM's Python runs by path: they import only vllm, torch,
                  safetensors and the standard library, and of draftsmith only the two modules
                  that define a wire format (trainer/data/shards.py, the shard writer, for
                  capture and the producer; trainer/data/wire.py and Ray for the producer)

Everything here talks to vLLM through a runner process, never by importing vllm: draftsmith's
own environment has no vLLM, and a runner's crash or hang is a line naming its log.
"""
