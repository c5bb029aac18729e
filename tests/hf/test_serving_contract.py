"""What vLLM's Transformers backend reads of the exported model's code to serve its layers with
its own attention (examples/serve_with_vllm.py runs vLLM itself, in CI's vLLM leg): the layers
it may take call the attention interface in their `forward`, looked up there by name; those it
must not take (Focus's gate and rule, a variant's own attention) have a `forward` of their own
that does not."""

import ast
import inspect
import textwrap

import torch

from megatron_focus.hf import modeling_megatron_focus as modeling


def _calls_the_interface(cls) -> bool:
    """Whether `cls.forward` assigns a lookup of ALL_ATTENTION_FUNCTIONS and calls it once."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    names = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and "ALL_ATTENTION_FUNCTIONS" in ast.unparse(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
    ]
    return len(calls) == 1 and any(k.arg == "scaling" for k in calls[0].keywords)


def test_dense_layers_call_the_interface_in_forward_and_the_others_do_not():
    assert _calls_the_interface(modeling.ATTENTION["standard"])
    assert _calls_the_interface(modeling.ATTENTION["xsa"])
    assert not _calls_the_interface(modeling.ATTENTION["focus"])
    assert not _calls_the_interface(modeling.ATTENTION["focus+xsa"])

    class Scaled(modeling.Attention):  # a variant's layer: its own attention
        def attend(self, q, k, v, pairs, routing=None):
            return super().attend(2 * q, k, v, pairs)

    assert not _calls_the_interface(Scaled)


def test_a_layer_computes_the_same_whether_it_calls_the_interface_itself_or_not():
    """The dense layer's call in `forward` and `attend`'s (what subclasses build on) agree."""
    from megatron_focus.hf.configuration_megatron_focus import MegatronFocusConfig

    config = MegatronFocusConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=4)  # fmt: skip
    config._attn_implementation = "eager"

    class Same(modeling.Attention):
        def attend(self, q, k, v, pairs, routing=None):
            return super().attend(q, k, v, pairs)

    torch.manual_seed(0)
    dense = modeling.Attention(config, 0).eval()
    same = Same(config, 0).eval()
    same.load_state_dict(dense.state_dict())
    x = torch.randn(2, 5, 32)
    pairs = modeling.CausalPairs(5, 0, None, x.device, None)
    with torch.no_grad():
        torch.testing.assert_close(same(x, None, pairs, None), dense(x, None, pairs, None))
