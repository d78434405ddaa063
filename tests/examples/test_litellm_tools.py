"""litellm, as agent code calls it, against a real art-server: a completion with `tools=`.

litellm (1.106) imports its MCP handler for every completion that has tools, and that handler
imports the `mcp` package: without it every such call fails with "No module named 'mcp'".
"""

from __future__ import annotations

import litellm

from examples.demo import task as demo


async def test_litellm_completion_with_tools(server):
    response = await litellm.acompletion(
        model="hosted_vllm/artisan-tiny", api_base=server.url + "/v1", api_key="x",
        messages=demo.ShopEnv(demo.make_example().train_tasks(0)[0]).initial_messages(), tools=demo.TOOLS,
        tool_choice="required", max_tokens=48, temperature=1.0, seed=0)
    calls = response.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_price"
