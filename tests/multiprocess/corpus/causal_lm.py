"""A small causal transformer language model: the script of issue 52.

What a user writes from the README and PyTorch's tutorials: token and
position embeddings, ``nn.TransformerEncoder`` with a causal mask, AdamW
with weight decay, a warmup + cosine ``LambdaLR`` built BEFORE the optimizer
is wrapped in ``hvd.DistributedOptimizer``, gradient clipping the Horovod way
(``optimizer.synchronize()``, clip, ``with optimizer.skip_synchronize():
optimizer.step()``), a ``DataLoader(num_workers=2)`` over ``ElasticSampler``,
a commit every 4 steps. The text: sequences of 16 tokens (vocabulary of 16)
from a fixed random Markov chain, made here. Dropout is 0 so the reference
(one process) draws no other random numbers than the elastic run.

``--reference``: one process, no Horovod, the whole global batch per step.
``--plain``: Horovod's ``hvd.elastic.TorchState`` and ``hvd.elastic.run``.
"""

import math

import _hooks

parser = _hooks.arguments(__doc__.split("\n")[0], global_batch=24)
parser.add_argument("--sequences", type=int, default=288)
args = parser.parse_args()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import horovod.torch as hvd  # noqa: E402

import elastic_ext  # noqa: E402
from elastic_ext.torch import ElasticSampler  # noqa: E402

torch.set_num_threads(1)
if not args.reference:
    hvd.init()
hooks = _hooks.Hooks(args, *(() if args.reference else (hvd.rank, hvd.size)))

VOCAB, LENGTH, WIDTH = 16, 16, 32


def markov_text(sequences, seed):
    """Token sequences from a random transition table with a few likely successors per token."""
    rng = np.random.default_rng(seed)
    table = rng.dirichlet(np.full(VOCAB, 0.3), size=VOCAB)
    tokens = np.empty((sequences, LENGTH + 1), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, VOCAB, sequences)
    for t in range(1, LENGTH + 1):
        cumulative = table[tokens[:, t - 1]].cumsum(axis=1)
        tokens[:, t] = (rng.random((sequences, 1)) < cumulative).argmax(axis=1)
    return torch.from_numpy(tokens)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, tokens):
        self.tokens = tokens

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return self.tokens[index, :-1], self.tokens[index, 1:], index


class CausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(1, LENGTH, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(LENGTH), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[:, :tokens.shape[1]]
        x = self.blocks(x, mask=self.mask, is_causal=True)
        return self.head(self.norm(x))


dataset = TokenDataset(markov_text(args.sequences, args.seed + 3))
steps_per_epoch = len(dataset) // args.global_batch
total_steps = args.epochs * steps_per_epoch
warmup_steps = 4

torch.manual_seed(args.seed)
model = CausalLM()
decay = [p for n, p in model.named_parameters() if p.dim() > 1 and n != "pos"]
no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1 or n == "pos"]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=3e-3, betas=(0.9, 0.95))


def warmup_cosine(step):
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
if not args.reference:
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
sampler = ElasticSampler(len(dataset), global_batch_size=args.global_batch, seed=args.seed + 1,
                         **(_hooks.one_process() if args.reference else {}))
loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2)

if args.reference:
    state, run = _hooks.LocalState(epoch=0, step=0), (lambda fn: fn)
elif args.plain:
    import horovod.torch.elastic.state as hvd_state
    _hooks.plain_handlers(hvd_state, ElasticSampler, torch.optim.lr_scheduler.LRScheduler)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                                   epoch=0, step=0)
    run = hvd.elastic.run
else:
    state = elastic_ext.State(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                              epoch=0, step=0)
    run = elastic_ext.run


def arrays():
    return _hooks.torch_arrays(model, optimizer)


@run
def train(state):
    hooks.started(state, sampler.epoch, sampler.cursor)
    while state.epoch < args.epochs:
        sampler.set_epoch(state.epoch)
        for inputs, targets, indices in loader:
            hooks.step(state, sampler.epoch, sampler.cursor, indices)
            optimizer.zero_grad()
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            loss.backward()
            if args.reference:
                norm = nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
            else:
                optimizer.synchronize()
                norm = nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                with optimizer.skip_synchronize():
                    optimizer.step()
            scheduler.step()
            sampler.record_step()
            state.step += 1
            hooks.trace(state, loss=loss.item(), lr=optimizer.param_groups[0]["lr"], norm=norm.item())
            if state.step % args.commit_every == 0:
                hooks.before_commit(state)
                state.commit()
                hooks.committed(state, arrays)
        state.epoch += 1
        state.commit()


train(state)
hooks.finish(state, arrays)
