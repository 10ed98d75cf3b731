//! The confirms of one channel, polled only when lapin wakes them.
//!
//! Every confirm gets a waker of its own that records its tag in a shared queue when
//! lapin resolves it; a round polls the new confirms and those in the queue. Because
//! lapin resolves confirms one after another on its own thread and wakes each right
//! after resolving it, any confirm resolved before one this task has seen is in the
//! queue (or new) by the time the next round takes it: the ordering the engine's
//! two-round certification relies on (see `engine.rs`).
//!
//! The confirms are kept in tag order (tags are handed out in publish order and
//! their writes finish in that order), so finding one is an index, not a hash.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use lapin::{Confirmation, PublisherConfirm};

use crate::engine::Tag;

#[derive(Default)]
struct Shared {
    woken: Mutex<Vec<Tag>>,
    parent: AtomicWaker,
}

struct ConfirmWaker {
    tag: Tag,
    shared: Arc<Shared>,
}

impl Wake for ConfirmWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Ok(mut woken) = self.shared.woken.lock() {
            woken.push(self.tag);
        }
        self.shared.parent.wake();
    }
}

struct Entry {
    confirm: PublisherConfirm,
    waker: Waker,
}

/// The unresolved confirms of one channel.
#[derive(Default)]
pub(crate) struct ConfirmSet {
    shared: Arc<Shared>,
    /// `entries[i]` is the confirm of tag `first + i` (`None`: resolved, or its
    /// write failed). The front is always `Some`.
    entries: VecDeque<Option<Entry>>,
    first: Tag,
    /// The `Some` entries.
    live: usize,
    new: Vec<Tag>,
    /// Taken from `shared.woken` (swapped, so neither side allocates per round).
    woken: Vec<Tag>,
}

impl ConfirmSet {
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Adds the confirm of `tag`; tags come in increasing order.
    pub fn insert(&mut self, tag: Tag, confirm: PublisherConfirm) {
        if self.entries.is_empty() {
            self.first = tag;
        }
        let Some(index) = tag
            .checked_sub(self.first)
            .and_then(|i| usize::try_from(i).ok())
        else {
            return;
        };
        while self.entries.len() < index {
            self.entries.push_back(None);
        }
        let waker = Waker::from(Arc::new(ConfirmWaker {
            tag,
            shared: self.shared.clone(),
        }));
        let entry = Some(Entry { confirm, waker });
        match self.entries.get_mut(index) {
            Some(slot) => {
                if slot.is_none() {
                    self.live += 1;
                }
                *slot = entry;
            }
            None => {
                self.entries.push_back(entry);
                self.live += 1;
            }
        }
        self.new.push(tag);
    }

    /// Registers `cx` for wake-ups, then polls the new and the woken confirms and
    /// returns those that resolved.
    pub fn poll_resolved(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Vec<(Tag, lapin::Result<Confirmation>)> {
        self.shared.parent.register(cx.waker());
        let mut tags = std::mem::take(&mut self.new);
        if let Ok(mut woken) = self.shared.woken.lock() {
            std::mem::swap(&mut *woken, &mut self.woken);
        }
        tags.append(&mut self.woken);
        let mut done = Vec::new();
        for &tag in &tags {
            let Some(index) = tag
                .checked_sub(self.first)
                .and_then(|i| usize::try_from(i).ok())
            else {
                continue;
            };
            let Some(slot) = self.entries.get_mut(index) else {
                continue;
            };
            let Some(entry) = slot else {
                continue;
            };
            let mut own = Context::from_waker(&entry.waker);
            if let Poll::Ready(result) = Pin::new(&mut entry.confirm).poll(&mut own) {
                *slot = None;
                self.live -= 1;
                done.push((tag, result));
            }
        }
        while let Some(None) = self.entries.front() {
            self.entries.pop_front();
            self.first += 1;
        }
        tags.clear();
        self.new = tags;
        done
    }
}
