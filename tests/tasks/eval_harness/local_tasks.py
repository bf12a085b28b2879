"""A tiny offline lm-evaluation-harness task group written to a directory: one task per request kind
(multiple choice and a cloze through loglikelihood, a perplexity through loglikelihood_rolling, a
greedy generation through generate_until), its documents in local jsonl files."""
import json
import os

GROUP = "tiny_local"
TASKS = ("tiny_choice", "tiny_cloze", "tiny_rolling", "tiny_generate")

DOCUMENTS = {
    "tiny_choice": [
        {"question": "The function returns a", "choices": [" list", " value", " banana"], "answer": 1},
        {"question": "To read a file, call", "choices": [" open", " close", " print the"], "answer": 0},
        {"question": "A dictionary maps keys to", "choices": [" values", " modules", " lines"], "answer": 0},
    ],
    "tiny_cloze": [
        {"text": "The interpreter reads the module and executes its statements"},
        {"text": "Each thread has its own stack of frames"},
        {"text": "Hello"},
    ],
    "tiny_rolling": [
        {"text": "The standard library contains built-in modules written in C that provide access to system "
                 "functionality such as file I/O that would otherwise be inaccessible to Python programmers, "
                 "as well as modules written in Python that provide standardized solutions for many problems."},
        {"text": "Short document."},
    ],
    "tiny_generate": [
        {"prompt": "The return value of the function is", "answer": " None"},
        {"prompt": "Example:\n>>> print(", "answer": "1)"},
    ],
}

CONFIGS = {
    "tiny_choice": {"output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
                    "doc_to_choice": "{{choices}}", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]},
    "tiny_cloze": {"output_type": "loglikelihood", "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
                   "doc_to_target": "{{' ' + text.split(' ')[-1]}}",
                   "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                                   {"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
    "tiny_rolling": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                     "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"},
                                     {"metric": "bits_per_byte"}]},
    "tiny_generate": {"output_type": "generate_until", "doc_to_text": "{{prompt}}", "doc_to_target": "{{answer}}",
                      "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6, "do_sample": False},
                      "metric_list": [{"metric": "exact_match"}]},
}


def write_local_tasks(directory: str) -> str:
    """Write the task files into ``directory`` (the harness's include path); return it."""
    os.makedirs(directory, exist_ok=True)
    for task in TASKS:
        data = os.path.join(directory, f"{task}.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(doc) + "\n" for doc in DOCUMENTS[task])
        config = {"task": task, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data}},
                  "test_split": "test", **CONFIGS[task], "metadata": {"version": 1.0}}
        with open(os.path.join(directory, f"{task}.yaml"), "w") as f:
            json.dump(config, f, indent=1)  # JSON is YAML
    with open(os.path.join(directory, f"{GROUP}.yaml"), "w") as f:
        json.dump({"group": GROUP, "task": list(TASKS), "metadata": {"version": 1.0}}, f, indent=1)
    return directory


def figures(results: dict) -> dict[str, float]:
    """``task/metric`` -> value of a harness result dict, standard errors left out."""
    return {f"{task}/{metric}": value for task, metrics in results["results"].items()
            for metric, value in metrics.items() if isinstance(value, float) and "stderr" not in metric}
