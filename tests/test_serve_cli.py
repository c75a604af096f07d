"""`pdserve serve MODEL [flags]`, the `vllm serve` of pdserve (pdserve.entrypoints.serve_cli,
vllm_flags): each vLLM flag either serves or is refused with a message naming the pdserve
equivalent or saying why, and `pdserve up` answers the flags it does not take with the same hints.

The refusals and the flag translation need no cluster (the CLI's parser and serve_settings, and
one subprocess for the exit and its one-line message). One real `pdserve serve builtin:tiny -tp 2`
cluster, with most of the accepted flags at once (TLS, CORS, --root-path, --api-key,
--max-model-len, --served-model-name, --seed, ...), is driven with the official openai client.
"""
from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.entrypoints.cli import build_parser, main
from pdserve.entrypoints.http_flags import http_flags
from pdserve.entrypoints.kv_pool import kv_pool_gb
from pdserve.entrypoints.launcher import Cluster
from pdserve.entrypoints.ray_launch import router_template
from pdserve.entrypoints.serve_cli import serve_settings
from pdserve.entrypoints.vllm_flags import VLLM_FLAGS, checkpoint_quantization
from pdserve.testing.up_cluster import running_cluster

ROOT = Path(__file__).resolve().parent.parent
FROM_VLLM = ROOT / "docs" / "from-vllm.md"


def serve_args(*flags: str, model: str = "builtin:tiny"):
    return serve_settings(build_parser().parse_args(["serve", model, *flags]))


REFUSED = [
    (["-q", "fp8"], "builtin:tiny holds unquantized weights, and pdserve does not quantize as it loads"),
    (["--tokenizer", "/nonexistent"], "pdserve reads the tokenizer from the model's own directory"),
    (["--revision", "main"], "builtin:tiny is not a Hub id (ORG/NAME): a local directory has one revision"),
    (["--trust-remote-code"], "pdserve runs no code from a checkpoint"),
    (["--reasoning-parser", "deepseek_r1"], "pdserve has no reasoning parsers"),
    (["--generation-config", "auto"], "only --generation-config vllm"),
    (["-pp", "2", "--prefill-pp", "2"], "-pp sets both roles' stages: give it, or --prefill-pp and --decode-pp"),
    (["-dp", "2"], "--decode-nodes N (and --prefill-nodes M)"),
    (["--no-enable-chunked-prefill"], "always chunks prefills: --max-num-batched-tokens"),
    (["--max-logprobs", "5"], "fixed at 20 logprobs"),
    (["--response-role", "bot"], "always have the role assistant"),
    (["--return-tokens-as-token-ids"], "logprobs name tokens by their text"),
    (["--ssl-keyfile", "key.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["-tp", "2", "--decode-tp", "2"], "-tp sets both roles' size: give it, or --prefill-tp and --decode-tp"),
]


@pytest.mark.parametrize("flags,message", REFUSED, ids=[f[0] for f, _ in REFUSED])
def test_serve_refuses_what_it_cannot_honour_with_why(flags, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        serve_args(*flags)
    assert str(err.value).startswith(flags[0] if flags[0].startswith("--") else "--")


def test_gpu_memory_utilization_is_refused_on_cpu_with_the_kv_pool_flags():
    import torch  # heavy: the check is about the machine's device
    if torch.cuda.is_available():
        pytest.skip("on CUDA the flag sizes the KV pool")
    with pytest.raises(ValueError, match="--kv-cache-memory-gb GB .* or --num-kv-blocks N"):
        serve_args("--gpu-memory-utilization", "0.9")


def test_gpu_memory_utilization_arithmetic():
    gib = 2**30
    # 0.9 of 80 GiB over 2 nodes, 2 GiB of weights each and the 1 GiB reserve.
    assert kv_pool_gb(0.9, 80 * gib, 2 * gib, nodes=2) == pytest.approx(36 - 2 - 1)
    assert kv_pool_gb(0.9, 80 * gib, 2 * gib, nodes=2, tp=2) == pytest.approx(36 - 1 - 1)
    with pytest.raises(ValueError, match="leaves no KV pool"):
        kv_pool_gb(0.1, 8 * gib, 4 * gib, nodes=2)


def test_quantization_is_checked_against_the_checkpoint(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "compressed-tensors"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert checkpoint_quantization(str(tmp_path)) == "compressed-tensors"
    assert serve_args("-q", "compressed_tensors", model=str(tmp_path)).model == str(tmp_path)
    with pytest.raises(ValueError, match="is quantized as compressed-tensors, not awq: drop -q"):
        serve_args("--quantization", "awq", model=str(tmp_path))


def test_accepted_flags_become_pdserve_settings():
    args = serve_args("-tp", "2", "--seed", "7", "--enable-auto-tool-choice", "--generation-config", "vllm",
                      "-pp", "2", "-dp", "1", "--enable-chunked-prefill", "--max-logprobs", "20",
                      "--response-role", "assistant", "--tokenizer", "builtin:tiny", "--max-model-len", "512",
                      "--root-path", "/api", "--allowed-origins", '["http://ui.example"]', "--disable-log-requests",
                      "--uvicorn-log-level", "info")
    assert args.prefill_tp == args.decode_tp == (2,)
    assert args.prefill_pp == args.decode_pp == (2,)
    assert args.model == "builtin:tiny"
    assert Cluster(args).node_cmd("decode", "decode-0", "tcp://127.0.0.1:1", [])[-2:] == ["--seed", "7"]
    assert http_flags(args) == ["--max-model-len", "512", "--allowed-origins", '["http://ui.example"]',
                                "--root-path", "/api", "--uvicorn-log-level", "info", "--disable-log-requests"]
    router = build_parser().parse_args(["router", *http_flags(args)])
    assert (router.allowed_origins, router.root_path, router.max_model_len) == (["http://ui.example"], "/api", 512)


def test_serve_has_up_defaults():
    up, serve = (vars(build_parser().parse_args([cmd])) for cmd in ("up", "serve"))
    vllm_only = {f.dest for f in VLLM_FLAGS} | {"model_tag", "func", "command"}
    assert {k: v for k, v in serve.items() if k not in vllm_only} == {k: v for k, v in up.items() if k not in vllm_only}
    assert (serve["prefill_nodes"], serve["decode_nodes"]) == (1, 1)


@pytest.mark.parametrize("flag", [f for f in VLLM_FLAGS], ids=[f.names[-1] for f in VLLM_FLAGS])
def test_up_answers_each_vllm_flag_with_its_equivalent(flag, capsys):
    value = [] if flag.switch else ["1"]
    with pytest.raises(SystemExit) as exit_:
        main(["up", flag.names[0], *value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(f"pdserve up: error: {flag.names[0]} (vLLM's) is not taken here: {flag.up}")
    assert "usage:" not in err


def test_cli_errors_are_one_line_not_usage(capsys):
    assert main(["up", "--no-such-flag"]) == 2
    assert capsys.readouterr().err.startswith("pdserve up: error: unrecognized arguments: --no-such-flag")
    with pytest.raises(SystemExit):
        main(["serve", "builtin:tiny", "--tool-call-parser", "pythonic"])
    err = capsys.readouterr().err
    assert "invalid choice: 'pythonic'" in err and "usage:" not in err


@pytest.mark.parametrize("command", [["up"], ["prefill", "--model", "builtin:tiny"]])
def test_a_negative_count_of_layer_groups_is_refused(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--push-layer-groups", "-1"])
    assert exit_.value.code == 2
    assert "--push-layer-groups: -1 groups of layers: give 0 (whole blocks) or more" in capsys.readouterr().err
    assert build_parser().parse_args([*command, "--push-layer-groups", "0"]).push_layer_groups == 0


def test_serve_exits_nonzero_with_the_message():
    cmd = [sys.executable, "-m", "pdserve", "serve", "builtin:tiny", "--trust-remote-code"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "pdserve: error: --trust-remote-code: pdserve runs no code from a checkpoint: it serves the "
        "architectures it implements (docs/models.md)"]


def test_the_from_vllm_page_lists_every_flag():
    text = FROM_VLLM.read_text()
    for flag in VLLM_FLAGS:
        assert all(f"`{name}`" in text for name in flag.names), flag.names


def _self_signed(folder: Path) -> tuple[str, str]:
    from cryptography import x509  # a test dependency only: the TLS test's certificate
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(folder / "key.pem"), str(folder / "cert.pem")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    key, cert = _self_signed(tmp_path_factory.mktemp("tls"))
    flags = ("builtin:tiny", "-tp", "2", "--max-model-len", "200", "--seed", "0", "--served-model-name", "tiny",
             "--api-key", "sk-serve", "--allowed-origins", '["http://ui.example"]', "--root-path", "/api",
             "--disable-log-requests", "--uvicorn-log-level", "warning", "--ssl-keyfile", key, "--ssl-certfile", cert,
             "--enable-auto-tool-choice", "--generation-config", "vllm", "-pp", "1", "-dp", "1",
             "--enable-chunked-prefill", "--max-logprobs", "20", "--response-role", "assistant",
             "--tokenizer", "builtin:tiny", "--dtype", "float32", "--block-size", "16", "--max-num-seqs", "8",
             "--local-prefill-threshold", "0")
    with running_cluster(*flags, as_given=True, command="serve") as (url, _):
        http = httpx.Client(verify=False)  # the certificate above is self-signed
        yield url, http, openai.OpenAI(base_url=f"{url}/v1", api_key="sk-serve", http_client=http)


def test_serve_runs_tp2_over_https_with_the_openai_client(served):
    url, http, client = served
    assert url.startswith("https://")
    nodes = http.get(f"{url}/health").json()["nodes"]
    assert {n["id"]: n["tensor_parallel_size"] for n in nodes} == {"prefill-0": 2, "decode-0": 2}
    assert [m.id for m in client.models.list()] == ["tiny"]
    done = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    assert done.usage.completion_tokens == 4
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError, match="maximum context length is 200 tokens"):
        client.completions.create(model="tiny", prompt="x" * 300, max_tokens=4)


def test_serve_honours_api_key_cors_and_root_path(served):
    url, http, _ = served
    assert http.get(f"{url}/v1/models").status_code == 401
    assert http.get(f"{url}/v1/models", headers={"Authorization": "Bearer sk-serve"}).status_code == 200
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = http.options(f"{url}/v1/completions", headers={"Origin": "http://ui.example", **preflight})
    assert allowed.headers["access-control-allow-origin"] == "http://ui.example"
    other = http.options(f"{url}/v1/completions", headers={"Origin": "http://other.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    assert http.get(f"{url}/openapi.json").json()["servers"] == [{"url": "/api"}]


def test_the_anthropic_sdk_authenticates_with_x_api_key(served):
    """Anthropic's clients send the key as x-api-key: --api-key takes it, and a wrong one is a 401
    in Anthropic's shape."""
    import anthropic  # only this test drives the Messages API here
    url, _, _ = served
    http = anthropic.DefaultHttpxClient(verify=False)  # the SDK's own httpx; the certificate is self-signed
    client = anthropic.Anthropic(base_url=url, api_key="sk-serve", http_client=http, max_retries=0)
    message = client.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert message.usage.output_tokens == 3 and message.stop_reason == "max_tokens"
    wrong = anthropic.Anthropic(base_url=url, api_key="sk-wrong", http_client=http, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                           "message": "Incorrect API key provided."}}


def test_ray_routers_get_the_http_flags_and_tls_is_refused(tmp_path):
    args = build_parser().parse_args(["up", "--max-model-len", "512", "--root-path", "/api"])
    assert router_template(args)[-4:] == ["--max-model-len", "512", "--root-path", "/api"]
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_text(""), cert.write_text("")
    tls = build_parser().parse_args(["up", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)])
    with pytest.raises(ValueError, match="not with --ray"):
        router_template(tls)
