import json
import test_environments as T
from test_environments import server_url  # noqa
def test_peek(server_url, tiny_model_dir, tmp_path):
    import verifiers as vf
    env = vf.load_environment("alphabet-sort", min_turns=3, max_turns=3, num_train_examples=2, num_eval_examples=1)
    out = T._generate(env, env.get_eval_dataset(), server_url, tiny_model_dir)[0]
    print(json.dumps({k: out[k] for k in ("completion","reward","metrics","stop_condition","is_truncated")}, default=str, indent=1)[:3000])
    env = vf.load_environment("reverse-text", num_train_examples=2, num_eval_examples=2)
    for out in T._generate(env, env.get_eval_dataset(), server_url, tiny_model_dir):
        print(out["completion"], out["answer"], out["reward"])
