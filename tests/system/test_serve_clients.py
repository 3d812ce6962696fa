"""What real clients of OpenAI's API need, through `meshnet serve --model qwen2.5-coder-1.5b`
(two worker processes) and the `openai` client: with tool_choice auto a call the model
writes as a fenced JSON object (Qwen2.5 does, where its Hermes template waits for
<tool_call>) is a tool call, whole and streamed, and its round trip ends in an answer;
tools with a response_format answer in the format; a browser's CORS preflight from an
allowed origin; llama-server's extras and routes."""

import json
import os
import urllib.request

import jsonschema
import openai
import pytest

from conftest import serving

MODEL = "qwen2.5-coder-1.5b"
ORIGIN = "http://ui.example:3000"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                           "summary": {"type": "string", "maxLength": 80}},
          "required": ["city", "summary"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}


@pytest.fixture(scope="module")
def url(qwen_path):
    with serving("--model", MODEL, "--ctx", "1024", "--max-sessions", "2", "--cors-origin", ORIGIN,
                 env=dict(os.environ)) as (base, *_):
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_auto_takes_a_fenced_json_call_as_a_tool_call_whole_and_streamed(client):
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=80).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    call = whole.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = [c.choices[0] for c in client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                                                    max_tokens=80, stream=True) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == ""   # the call's text is never shown as content
    calls = [t for c in chunks for t in c.delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in calls] == [("get_weather", call.function.arguments)]
    assert chunks[-1].finish_reason == "tool_calls"
    # the round trip: the call and its result back, and the model answers (a text, no call)
    after = client.chat.completions.create(
        model=MODEL, tools=[WEATHER], max_tokens=80,
        messages=ASK + [whole.message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]).choices[0]
    assert after.finish_reason == "stop" and after.message.content and not after.message.tool_calls


def test_auto_streams_a_code_answer_as_it_comes(client):
    chunks = [c.choices[0].delta.content for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write Python that prints hello, in a code block."}],
        tools=[WEATHER], max_tokens=40, stream=True) if c.choices and c.choices[0].delta.content]
    assert len(chunks) >= 4 and "```" in "".join(chunks)   # held back at most until the fence's first line


def test_tools_with_a_response_format_call_then_answer_in_the_format(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], response_format=FORMAT,
                                           max_tokens=120).choices[0]
    assert first.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]
    final = client.chat.completions.create(
        model=MODEL, tools=[WEATHER], response_format=FORMAT, max_tokens=120,
        messages=ASK + [first.message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]).choices[0]
    assert final.finish_reason == "stop" and not final.message.tool_calls
    jsonschema.validate(json.loads(final.message.content), ANSWER)


def http(url, path, method="GET", body=None, headers=None):
    request = urllib.request.Request(url + path, None if body is None else json.dumps(body).encode(), method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_a_cors_preflight_from_the_allowed_origin_is_answered_and_another_origin_s_is_not(url):
    asked = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    status, headers, _ = http(url, "/v1/chat/completions", "OPTIONS", headers={"Origin": ORIGIN, **asked})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    status, headers, _ = http(url, "/v1/models", headers={"Origin": ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = http(url, "/v1/chat/completions", "OPTIONS", headers={"Origin": "http://other.example", **asked})
    assert status == 400 and "access-control-allow-origin" not in headers


def test_llama_server_s_extras_and_routes(url, client):
    ask = [{"role": "user", "content": "Count from one to twenty."}]
    status, _, body = http(url, "/v1/chat/completions", "POST",
                           {"model": MODEL, "messages": ask, "n_predict": 5, "cache_prompt": False,
                            "chat_template_kwargs": {}})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 5
    status, _, body = http(url, "/v1/chat/completions", "POST",
                           {"model": MODEL, "messages": ask, "chat_template_kwargs": {"enable_thinking": True}})
    assert status == 400 and json.loads(body)["error"]["param"] == "chat_template_kwargs"
    status, _, body = http(url, "/props")
    assert status == 200 and json.loads(body)["default_generation_settings"]["n_ctx"] == 1024
    status, _, body = http(url, "/slots")
    assert status == 200 and len(json.loads(body)) == 2
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input="hello")
    assert "embeddings are not supported" in refused.value.message


# ---- the frameworks people build agents with: each gets its tool called under tool_choice auto

def get_weather(city: str) -> str:
    """The weather now in a city."""
    return f"Sunny, 21 C in {city}"


def test_langchain_bind_tools_gets_its_tool_called_with_auto(url):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    weather = tool(get_weather)
    llm = ChatOpenAI(base_url=url + "/v1", api_key="none", model=MODEL, temperature=0, max_retries=0, max_tokens=120)
    bound = llm.bind_tools([weather])   # tool_choice: auto
    messages = [HumanMessage("What is the weather in Paris?")]
    ai = bound.invoke(messages)
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("get_weather", {"city": "Paris"})]
    messages += [ai] + [ToolMessage(weather.invoke(c["args"]), tool_call_id=c["id"]) for c in ai.tool_calls]
    # With the tool still offered, this 1.5B model copies its template's example call
    # (`{{"name": ...}}`, a typo in Qwen2.5's template) as text; stock llama-server at the
    # pin writes the same bytes. It is no call, so the round trip ends there, as an agent
    # loop sees it; offered no tools, the model answers from the tool's result.
    again = bound.invoke(messages)
    assert again.response_metadata["finish_reason"] == "stop" and not again.tool_calls and again.content
    answer = llm.invoke(messages).content.lower()
    assert "sunny" in answer and "21" in answer, answer


def test_a_pydantic_ai_agent_runs_its_tool_and_ends_with_a_structured_output(url):
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Weather(BaseModel):
        city: str
        summary: str

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=url + "/v1", api_key="none"))
    agent = Agent(model, output_type=Weather, model_settings={"temperature": 0, "max_tokens": 150})
    asked = []

    @agent.tool_plain
    def weather(city: str) -> str:
        """The weather now in a city."""
        asked.append(city)
        return get_weather(city)
    result = agent.run_sync("What is the weather in Paris?")
    assert asked == ["Paris"] and result.output.city == "Paris" and "Sunny" in result.output.summary


def test_the_llm_cli_runs_its_functions(url, tmp_path):
    import subprocess
    import sys

    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: meshnet\n  model_name: {MODEL}\n  api_base: \"{url}/v1\"\n  supports_tools: true\n")
    llm = os.path.join(os.path.dirname(sys.executable), "llm")
    done = subprocess.run([llm, "-m", "meshnet", "--functions", "def get_weather(city: str) -> str:\n"
                           "    \"The weather now in a city.\"\n    return 'Sunny, 21 C'\n",
                           "What is the weather in Paris?", "--td", "--cl", "2"],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, LLM_USER_PATH=str(tmp_path), LLM_LOAD_PLUGINS="", OPENAI_API_KEY="none"))
    said = done.stdout + done.stderr   # (--td writes the calls to stderr)
    assert "Tool call: get_weather({'city': 'Paris'})" in said and "Sunny, 21 C" in said, said
