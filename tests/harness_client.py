"""A harness outside the trainer (`--env agent:external`), as tests/test_harness_gate.py starts it: a process of
its own that claims episodes, plays each with the official `openai` client and reports the reward.

    python tests/harness_client.py http://127.0.0.1:PORT      # the key in $AGENTRL_HARNESS_KEY

It prints its network namespace, checks that a claim without the key is refused (prints "keyless: 401"),
then loops until the run is over (410, or the gate gone), printing one line per episode.
"""
import os
import sys
import time

import httpx
import openai


def main(url: str) -> None:
    key = os.environ["AGENTRL_HARNESS_KEY"]
    for _ in range(600):  # the trainer opens the gate at its first rollout, once the model has loaded
        try:
            httpx.get(f"{url}/health")
            break
        except httpx.TransportError:
            time.sleep(0.5)
    print("netns:", os.readlink("/proc/self/ns/net"), flush=True)
    print("keyless:", httpx.post(f"{url}/episodes", params={"wait_s": 0}).status_code, flush=True)
    gate = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=90)
    episodes = 0
    while True:
        try:
            r = gate.post("/episodes", params={"wait_s": 5})
        except httpx.TransportError:  # the trainer has closed the gate: the run is over
            break
        if r.status_code == 410:
            break
        if r.status_code == 204:
            continue
        r.raise_for_status()
        ep = r.json()
        reward = play(ep, key, url)
        gate.post(f"/episodes/{ep['episode_id']}/reward", json={"reward": reward}).raise_for_status()
        episodes += 1
        print(f"episode {ep['task_id']}: reward {reward}", flush=True)
    print(f"done: {episodes} episodes", flush=True)


def play(ep: dict, key: str, url: str) -> float:
    """One episode (a claim's answer) with the official client: two requests, the second with the first reply in
    its history; the reward depends on what was sampled, so GRPO groups differ."""
    client = openai.OpenAI(base_url=ep["base_url"], api_key=key, max_retries=0)
    messages = [{"role": "user", "content": ep["task"]["question"]}]
    first = client.chat.completions.create(model=ep["model"], messages=messages, max_tokens=12)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
    # the second turn through the fixed base URL, the episode named in a header
    fixed = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0,
                          default_headers={"agentrl-episode": ep["episode_id"]})
    second = fixed.chat.completions.create(model=ep["model"], messages=messages)
    text = (first.choices[0].message.content or "") + (second.choices[0].message.content or "")
    return float(text.count("o") % 2)


if __name__ == "__main__":
    main(sys.argv[1])
