"""Draft algorithms. The registry is one dict, `DRAFTS[name]` -> the module implementing
it, and every caller (training, evaluation, export, the demo) goes through it.

The draft contract (tests/test_contract.py holds every module to it): each module under
trainer/drafts/ provides

    Config                      dataclass: the draft's shape (trainer/drafts/shape.py
                                TargetShape: the fields taken from the target, one rule for
                                draft_vocab_size) and its objective; `validate()`;
                                `num_positions` (K, the draft positions trained and measured
                                per sample position, and the N served by default);
                                `max_draft_tokens` (the largest N it proposes; None: any)
    default_layer_ids(L)        aux layer ids for a target of L layers, strictly increasing, in
                                the one convention draftsmith stores (trainer/layer_ids.py)
    Draft(cfg, embed, lm_head)  the served nn.Module (the target's embedding, and LM head where the
                                draft has none of its own, are shared, frozen, outside its state
                                dict); `set_vocab(d2t, t2d)`, `draft_to_target()`,
                                `gradient_checkpointing`
    fill_from_data(cfg, counts, special_ids)
                                config fields taken from the training data (DFlash, DSpark: the mask token)
    target_labels(target, batch, draft) -> dict
                                the labels from the captured states (and the captured
                                target_argmax), no grad
    training_step(draft, batch, labels) -> trainer.metrics.StepMetrics
                                loss and per-position correct/count
    Proposer(draft, draft_sampling, seed, **options)
                                the in-tree decoder's draft (trainer.speculative.Draft protocol);
                                `OPTIONS` names the keyword options it takes (DSpark: markov,
                                draft_topk), `ABLATIONS` the variants eval can also measure
                                ({name: options}), `parallel` whether it proposes a round's N
                                tokens in one forward

The registry (`trainer/drafts/registry.py`: `DRAFTS`, `get`, `build`, `TrainStep`) is the one
way to reach an algorithm and to make a Draft for a target; `trainer/drafts/folder.py` owns the
trained-draft folder. Serialization for vLLM is not a draft's business: export/ holds one
exporter per algorithm under the same registry name.
"""
