"""An agent program written with LangGraph (a model node and a tool node in a graph, LangChain's ``ChatOpenAI``
as the model), trained by agentrl through its capture endpoint as it is:

    PYTHONPATH=. agentrl train grpo --env agent:examples.langgraph_agent:run_agent \
        env_kwargs.tasks=examples/calc_tasks.jsonl

Needs ``pip install langgraph langchain-openai``. The tasks and the calculator are ``examples/calc_agent.py``'s;
the graph loops model -> tools -> model until the model answers without a call (at most 4 model turns).
"""
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from examples.calc_agent import SYSTEM, question, solved
from examples.calc_agent import calculator as evaluate


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value."""
    return evaluate(expression)


def run_agent(task: dict, endpoint) -> dict:
    model = ChatOpenAI(model=endpoint.model, base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0,
                       timeout=endpoint.timeout_s).bind_tools([calculator])

    def call_model(state: MessagesState) -> dict:
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([calculator]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)  # a call: to the tools; none: the end
    graph.add_edge("tools", "model")
    messages = [SystemMessage(SYSTEM), HumanMessage(question(task))]
    try:
        final = graph.compile().invoke({"messages": messages}, {"recursion_limit": 8})  # 4 model turns
    except GraphRecursionError:  # still calling tools at the step limit: no answer
        return {"reward": 0.0, "success": False}
    text = final["messages"][-1].content if isinstance(final["messages"][-1].content, str) else ""
    won = solved(text, task["answer"])
    return {"reward": float(won), "success": won}
