"""Python functions the PPO recipe's tool environment can offer, by dotted path in YAML::

    model:
      environment:
        class_path: lightning_mem.rl.tools.ToolEnvironment
        init_args:
          tools: [recipes.tools.calculator]
          reward: {class_path: recipes.rewards.ArithmeticReward, init_args: {extract: last_integer}}

A tool is a plain function with type hints and a Google-style docstring: transformers writes the
JSON schema the chat template shows the model from them (``transformers.utils.get_json_schema``).
"""

from __future__ import annotations

import ast
import operator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only integers, +, - and * are allowed")


def calculator(expression: str) -> int:
    """
    Evaluate an integer arithmetic expression.

    Args:
        expression: The expression, with integers, +, - and * only (for example "12 + 7").
    """
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")
    return _evaluate(ast.parse(expression.strip(), mode="eval").body)
