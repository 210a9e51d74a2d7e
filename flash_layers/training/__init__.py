"""Training and evaluation of document classifiers: what train.py and eval.py run.

    config.py      default_config() (every field documented) and validate()
    task.py        config -> model, initial params, tokenizer, batches
    optimizer.py   AdamW, warmup + decay, weight-decay mask, clipping
    state.py       TrainState created directly sharded from logical axis names
    steps.py       jitted train step (gradient accumulation) and eval step
    checkpoint.py  orbax: latest + best, data-iterator state, fallback past damaged steps
    metrics.py     accuracy / macro-F1, throughput and MFU, metrics.jsonl + TensorBoard
    loop.py        train_and_evaluate(config, workdir): resume, preemption, dev eval, summary
    evaluate.py    evaluate_checkpoint(): eval_metrics.json, predictions
    distributed.py jax.distributed start-up, process-0 logging
    aot.py         dry_run(): compile for TPU slices, report HBM, FLOPs, DCN vs ICI bytes
    collectives.py which mesh axes and network each collective of a compiled program uses
    plot.py        training curves from metrics.jsonl
"""
