"""Training data: where rows come from (:mod:`.rows`), the chat shapes and their rendering
(:mod:`.chat`), SFT tokenization and batching (:mod:`.sft`), preference pairs (:mod:`.pairs`,
:mod:`.preference`), and RL prompt sets (:mod:`.prompts`).

The datamodules (``lightning_mem.data.SFTDataModule``, ``lightning_mem.data.PreferenceDataModule``,
``lightning_mem.data.PromptDataModule``) and the helpers are importable from here.
"""

from lightning_mem.data.rows import (  # noqa: F401
    DataFormatError,
    is_saved_dataset,
    check_data_file,
    read_rows,
    read_hub_rows,
    rename_columns,
    check_columns,
    DataSource,
    data_source,
    warn_once,
)

from lightning_mem.data.chat import (  # noqa: F401
    check_messages,
    row_to_conversation,
    row_to_messages,
    row_to_prompt_messages,
    render_with_spans,
    render_prompt,
    encode_rendered,
    encode_prompt,
)

from lightning_mem.data.sft import (  # noqa: F401
    IGNORE_INDEX,
    TokenizeStats,
    tokenize_example,
    tokenize_rows,
    TokenizedDataset,
    collate_right_padded,
    SFTDataModule,
)

from lightning_mem.data.pairs import (  # noqa: F401
    PairStats,
    row_to_pair,
)

from lightning_mem.data.preference import (  # noqa: F401
    PreferenceDataset,
    PairCollator,
    PreferenceDataModule,
    flatten_pair_rows,
)

from lightning_mem.data.prompts import (  # noqa: F401
    PromptDataset,
    collate_left_padded,
    FullBatchSampler,
    PromptDataModule,
)

__all__ = [
    "DataFormatError",
    "is_saved_dataset",
    "check_data_file",
    "read_rows",
    "read_hub_rows",
    "rename_columns",
    "check_columns",
    "DataSource",
    "data_source",
    "warn_once",
    "check_messages",
    "row_to_conversation",
    "row_to_messages",
    "row_to_prompt_messages",
    "render_with_spans",
    "render_prompt",
    "encode_rendered",
    "encode_prompt",
    "IGNORE_INDEX",
    "TokenizeStats",
    "tokenize_example",
    "tokenize_rows",
    "TokenizedDataset",
    "collate_right_padded",
    "SFTDataModule",
    "PairStats",
    "row_to_pair",
    "PreferenceDataset",
    "PairCollator",
    "PreferenceDataModule",
    "flatten_pair_rows",
    "PromptDataset",
    "collate_left_padded",
    "FullBatchSampler",
    "PromptDataModule",
]
