"""HtFLlib's text models (fastText, TextLogisticRegression, LSTMNet, BiLSTM, GRUNet, Transformer)
for PFLlib's AG News token rows, at HtFLlib's sizes: every hidden width is K (HtFLlib passes
``hidden_dim=args.feature_dim``), the vocabulary is the data's (see :mod:`.inputs`).

Each is split as HtFLlib's BaseHeadSplit splits it: the model's ``fc`` classifier is replaced
by the average pool to K (the identity here: what reaches ``fc`` is K wide), so the feature
vector is what HtFLlib's base returns, everything the model's ``forward`` does after ``fc``
included. That makes the features of fastText, TextLogisticRegression, LSTMNet and GRUNet
``log_softmax`` of the K-wide vector (those forwards end in ``F.log_softmax``), while BiLSTM's
and the Transformer's are the plain vector. The head is a fresh ``Linear(K, C)``, drawn where the
model's own classifier is, so ``model.init=htfllib`` gives HtFLlib's weights.

Padding as HtFLlib's models treat it (PFLlib's generator pads ids with 0 to ``max_len`` and
stores each sequence's length, which it takes after padding, so every length is ``max_len``):

* fastText and TextLogisticRegression average the embeddings of all ``L`` positions (fastText's
  embedding has ``padding_idx=0``, a zero vector; TextLogisticRegression's has none).
* LSTMNet and GRUNet run the recurrent net over each sequence's first ``length`` positions
  (packed). LSTMNet then reads position ``L' - 1`` of the padded output, ``L'`` the longest length
  in the batch, so a shorter sequence gives zeros there; GRUNet reads the last layer's final state.
* BiLSTM runs over all ``L`` positions and reads position ``length - 1`` of both directions.
  HtFLlib builds it without attention (its ``attention=False`` default); ``bilstm_attention`` is
  the same network with its Luong attention over the first ``length`` positions switched on.
* The Transformer attends over all ``L`` positions (no padding mask) and reads position 0.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from htfl_dist.errors import ConfigError

from .base import SplitModel, linear_head
from .inputs import InputSpec, split_tokens
from .registry import InputNeed, register_architecture

TEXT = InputNeed("text", "text (token ids and lengths, PFLlib's AG News layout)")

RNN_LAYERS = 2
RNN_DROPOUT = 0.2
PADDING_ID = 0
TRANSFORMER_FEEDFORWARD = 2048
TRANSFORMER_DROPOUT = 0.1
TRANSFORMER_INIT_RANGE = 0.1


def _cpu_lengths(lengths: Tensor) -> Tensor:
    """``pack_padded_sequence`` takes its lengths on the CPU."""
    return lengths.to("cpu", torch.int64)


class FastText(nn.Module):
    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, width, PADDING_ID)
        self.fc1 = nn.Linear(width, width)

    def forward(self, rows: Tensor) -> Tensor:
        tokens, _ = split_tokens(rows)
        return F.log_softmax(self.fc1(self.embedding(tokens).mean(1)), dim=1)


class TextLogisticRegression(nn.Module):
    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, width)

    def forward(self, rows: Tensor) -> Tensor:
        tokens, _ = split_tokens(rows)
        return F.log_softmax(self.embedding(tokens).mean(1), dim=1)


class RecurrentNet(nn.Module):
    """LSTMNet (``cell="lstm"``: last padded position, ReLU) or GRUNet (``"gru"``: final state)."""

    def __init__(self, vocab_size: int, width: int, cell: str) -> None:
        super().__init__()
        self.cell = cell
        self.dropout = nn.Dropout(RNN_DROPOUT)
        self.embedding = nn.Embedding(vocab_size, width, PADDING_ID)
        recurrent = nn.LSTM if cell == "lstm" else nn.GRU
        self.rnn = recurrent(input_size=width, hidden_size=width, num_layers=RNN_LAYERS, dropout=RNN_DROPOUT,
                             batch_first=True)

    def forward(self, rows: Tensor) -> Tensor:
        tokens, lengths = split_tokens(rows)
        packed = nn.utils.rnn.pack_padded_sequence(self.embedding(tokens), _cpu_lengths(lengths), batch_first=True,
                                                   enforce_sorted=False)
        output, state = self.rnn(packed)
        if self.cell == "lstm":
            padded, _ = nn.utils.rnn.pad_packed_sequence(output, batch_first=True)
            last = torch.relu(padded[:, -1, :])
        else:
            last = state[-1]
        return F.log_softmax(self.dropout(last), dim=1)


class BiLSTM(nn.Module):
    """FedNLP's BiLSTM classifier as HtFLlib builds it (dropouts 0, one layer)."""

    def __init__(self, vocab_size: int, width: int, attention: bool) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, width)
        self.embedding_dropout = nn.Dropout(0.0)
        self.attention_layer = nn.Linear(4 * width, 2 * width) if attention else None
        self.lstm = nn.LSTM(width, width, 1, dropout=0.0, bidirectional=True)
        self.lstm_dropout = nn.Dropout(0.0)
        self.fc1 = nn.Linear(2 * width, width)

    def forward(self, rows: Tensor) -> Tensor:
        tokens, lengths = split_tokens(rows)
        embedded = self.embedding_dropout(self.word_embeddings(tokens))
        output, _ = self.lstm(embedded.permute(1, 0, 2))
        output = output.permute(1, 0, 2)  # (B, L, 2K)
        last = (lengths - 1).clamp(min=0)
        state = self.lstm_dropout(output[torch.arange(output.shape[0], device=output.device), last])
        if self.attention_layer is not None:
            state = self.attention_layer(torch.cat((self._attend(output, state, lengths), state), dim=1))
        return self.fc1(state)

    @staticmethod
    def _attend(output: Tensor, state: Tensor, lengths: Tensor) -> Tensor:
        """Luong attention of ``state`` over each sequence's first ``length`` outputs."""
        scores = torch.bmm(output, state.unsqueeze(2)).squeeze(2)
        positions = torch.arange(output.shape[1], device=output.device)
        scores = scores.masked_fill(positions.unsqueeze(0) >= lengths.unsqueeze(1), float("-inf"))
        return torch.bmm(torch.softmax(scores, dim=1).unsqueeze(1), output).squeeze(1)


class PositionalEncoding(nn.Module):
    """The sinusoidal table of the PyTorch tutorial HtFLlib's Transformer follows, then dropout."""

    table: Tensor  # a buffer (register_buffer)

    def __init__(self, width: int, length: int) -> None:
        super().__init__()
        self.dropout = nn.Dropout(TRANSFORMER_DROPOUT)
        position = torch.arange(length).unsqueeze(1)
        frequency = torch.exp(torch.arange(0, width, 2) * (-math.log(10000.0) / width))
        table = torch.zeros(1, length, width)
        table[0, :, 0::2] = torch.sin(position * frequency)
        table[0, :, 1::2] = torch.cos(position * frequency)[:, : width // 2]
        self.register_buffer("table", table)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(x + self.table[:, : x.shape[1]])


class TextTransformer(nn.Module):
    def __init__(self, vocab_size: int, width: int, heads: int, layers: int, length: int) -> None:
        super().__init__()
        self.width = width
        self.positions = PositionalEncoding(width, length)
        layer = nn.TransformerEncoderLayer(width, heads, TRANSFORMER_FEEDFORWARD, TRANSFORMER_DROPOUT,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.embedding = nn.Embedding(vocab_size, width)

    def forward(self, rows: Tensor) -> Tensor:
        tokens, _ = split_tokens(rows)
        encoded = self.encoder(self.positions(self.embedding(tokens) * math.sqrt(self.width)))
        return encoded[:, 0]


def _split(name: str, extractor: nn.Module, num_classes: int, feature_dim: int) -> SplitModel:
    return SplitModel(extractor, linear_head(feature_dim, num_classes), feature_dim, arch=name)


@register_architecture("fasttext", needs=TEXT)
def build_fasttext(*, num_classes: int, feature_dim: int, inputs: InputSpec) -> SplitModel:
    """fastText: mean embedding, ``Linear(K, K)``, log_softmax."""
    return _split("fasttext", FastText(inputs.vocab_size, feature_dim), num_classes, feature_dim)


@register_architecture("text_logreg", needs=TEXT)
def build_text_logreg(*, num_classes: int, feature_dim: int, inputs: InputSpec) -> SplitModel:
    """TextLogisticRegression: mean embedding, log_softmax."""
    return _split("text_logreg", TextLogisticRegression(inputs.vocab_size, feature_dim), num_classes, feature_dim)


@register_architecture("lstm", needs=TEXT)
def build_lstm(*, num_classes: int, feature_dim: int, inputs: InputSpec) -> SplitModel:
    """LSTMNet: two-layer LSTM of width K (dropout 0.2), ReLU of the last padded position."""
    return _split("lstm", RecurrentNet(inputs.vocab_size, feature_dim, "lstm"), num_classes, feature_dim)


@register_architecture("gru", needs=TEXT)
def build_gru(*, num_classes: int, feature_dim: int, inputs: InputSpec) -> SplitModel:
    """GRUNet: two-layer GRU of width K (dropout 0.2), the last layer's final state."""
    return _split("gru", RecurrentNet(inputs.vocab_size, feature_dim, "gru"), num_classes, feature_dim)


@register_architecture("bilstm", needs=TEXT)
def build_bilstm(*, num_classes: int, feature_dim: int, inputs: InputSpec) -> SplitModel:
    """BiLSTM_TextClassification as HtFLlib's groups build it (no attention)."""
    return _split("bilstm", BiLSTM(inputs.vocab_size, feature_dim, attention=False), num_classes, feature_dim)


@register_architecture("bilstm_attention", needs=TEXT)
def build_bilstm_attention(*, num_classes: int, feature_dim: int, inputs: InputSpec) -> SplitModel:
    """BiLSTM_TextClassification with its Luong attention switched on."""
    return _split("bilstm_attention", BiLSTM(inputs.vocab_size, feature_dim, attention=True), num_classes,
                  feature_dim)


TRANSFORMER_SHAPES: tuple[tuple[int, int], ...] = (
    (8, 1), (8, 2), (8, 4), (8, 8), (8, 16), (1, 4), (2, 4), (4, 4), (16, 4), (1, 1), (2, 2), (16, 16),
)
"""(attention heads, layers) of the Transformers HtFLlib's text groups use."""


def _register_transformer(heads: int, layers: int) -> None:
    name = f"transformer_h{heads}_l{layers}"

    @register_architecture(name, needs=TEXT)
    def build(*, num_classes: int, feature_dim: int, inputs: InputSpec) -> SplitModel:
        if feature_dim % heads:
            raise ConfigError(f"architecture {name!r} splits K over {heads} attention heads; "
                              f"model.feature_dim={feature_dim} is not divisible by {heads}")
        extractor = TextTransformer(inputs.vocab_size, feature_dim, heads, layers, inputs.shape[0])
        head = linear_head(feature_dim, num_classes)  # drawn where the Transformer's fc is
        # The Transformer's init_weights: embedding and classifier uniform(-0.1, 0.1), bias 0.
        nn.init.uniform_(extractor.embedding.weight, -TRANSFORMER_INIT_RANGE, TRANSFORMER_INIT_RANGE)
        nn.init.zeros_(head.bias)
        nn.init.uniform_(head.weight, -TRANSFORMER_INIT_RANGE, TRANSFORMER_INIT_RANGE)
        return SplitModel(extractor, head, feature_dim, arch=name)

    build.__name__ = f"build_{name}"
    build.__doc__ = f"TransformerModel: {heads} heads, {layers} layers, width K, class token at position 0."


for _heads, _layers in TRANSFORMER_SHAPES:
    _register_transformer(_heads, _layers)
