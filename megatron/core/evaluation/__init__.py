"""Zero-shot evaluation of a language model given as a logits function.

    windows = read_wikitext(path, tokenizer, seq_length, overlapping_eval)   # perplexity
    examples = read_lambada(path, tokenizer, seq_length, strict)              # cloze accuracy
    total = evaluate_samples(logits_fn, windows, micro_batch_size, "loss")
    print(perplexity_report(total, windows).line("WIKITEXT103"))

``logits_fn(tokens [b, s]) -> logits [b, s, V]`` is any causal language model over the padded
vocabulary: a plain GPTModel, or the model of a checkpoint run under its TP/PP (every rank gets
the full logits). Nothing here knows about process groups or the trainer's flags.
"""
