//! The part of Python's pickle machine that `torch.save(state_dict)` needs, as data only: no
//! class is ever instantiated and no callable ever run. Containers are shared (`Rc`), so a memo
//! entry fetched a million times costs a million pointers, not a million copies.
//!
//! Accepted callables (`REDUCE`, `NEWOBJ`): `torch._utils._rebuild_tensor_v2` and
//! `_rebuild_tensor` (a tensor: storage, offset, size, stride), `_rebuild_parameter` (its
//! tensor), `torch._tensor._rebuild_from_type_v2` (its inner call) and `collections.OrderedDict`
//! (an empty dict). Anything else is refused, naming it.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// A storage reference: `('storage', torch.FloatStorage, '0', 'cpu', 6)`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StorageRef {
    /// The record's name under `data/`.
    pub key: String,
    /// The storage class, e.g. `FloatStorage`.
    pub type_name: String,
    /// Elements declared.
    pub numel: i64,
}

/// A tensor as `_rebuild_tensor_v2` describes it: a strided view of a storage.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TensorRef {
    pub storage: Rc<StorageRef>,
    pub offset: i64,
    pub shape: Vec<i64>,
    pub stride: Vec<i64>,
}

/// A pickled value. Not `Debug`: a hostile pickle can nest or cycle values without end.
#[derive(Clone)]
pub(crate) enum Value {
    None,
    Bool,
    Int(i64),
    Float,
    Str(Rc<str>),
    Bytes,
    Tuple(Rc<[Value]>),
    List(Rc<RefCell<Vec<Value>>>),
    Dict(Rc<RefCell<Vec<(Value, Value)>>>),
    Global(Rc<(String, String)>),
    Storage(Rc<StorageRef>),
    Tensor(Rc<TensorRef>),
}

impl Value {
    /// The Python type it stands for, for messages.
    fn kind(&self) -> &'static str {
        match self {
            Self::None => "None",
            Self::Bool => "bool",
            Self::Int(_) => "int",
            Self::Float => "float",
            Self::Str(_) => "str",
            Self::Bytes => "bytes",
            Self::Tuple(_) => "tuple",
            Self::List(_) => "list",
            Self::Dict(_) => "dict",
            Self::Global(_) => "class",
            Self::Storage(_) => "storage",
            Self::Tensor(_) => "tensor",
        }
    }

    /// Moves the children of a container no one else holds into `out`.
    fn take_children(&mut self, out: &mut Vec<Value>) {
        match self {
            Self::Tuple(items) => {
                if let Some(items) = Rc::get_mut(items) {
                    out.extend(
                        items
                            .iter_mut()
                            .map(|item| std::mem::replace(item, Value::None)),
                    );
                }
            }
            Self::List(items) => {
                if let Some(items) = Rc::get_mut(items) {
                    out.append(items.get_mut());
                }
            }
            Self::Dict(pairs) => {
                if let Some(pairs) = Rc::get_mut(pairs) {
                    for (key, value) in pairs.get_mut().drain(..) {
                        out.push(key);
                        out.push(value);
                    }
                }
            }
            _ => {}
        }
    }
}

impl Drop for Value {
    /// Drops nested containers with a loop instead of recursion: a pickle of a few megabytes can
    /// nest a million tuples, which a recursive drop would overflow the stack on.
    fn drop(&mut self) {
        let mut pending = Vec::new();
        self.take_children(&mut pending);
        while let Some(mut value) = pending.pop() {
            value.take_children(&mut pending);
        }
    }
}

/// Why a pickle was refused, with the byte offset where that was found.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PickleError {
    pub offset: usize,
    pub problem: String,
}

impl std::fmt::Display for PickleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "data.pkl at byte {}: {}", self.offset, self.problem)
    }
}

/// Most values on the stack at once; a real state dict's pickle needs a few dozen.
const MAX_STACK: usize = 1 << 20;

/// Runs the pickle and returns the value it builds.
pub(crate) fn load(bytes: &[u8]) -> Result<Value, PickleError> {
    Machine {
        bytes,
        position: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
    }
    .run()
}

struct Machine<'a> {
    bytes: &'a [u8],
    position: usize,
    stack: Vec<Value>,
    /// Stack lengths at each `MARK`.
    marks: Vec<usize>,
    memo: HashMap<u32, Value>,
}

impl Machine<'_> {
    fn run(mut self) -> Result<Value, PickleError> {
        loop {
            let at = self.position;
            let opcode = self.take_u8()?;
            match opcode {
                b'.' => return self.pop(),
                0x80 => {
                    self.take_u8()?; // PROTO
                }
                0x95 => {
                    self.take(8)?; // FRAME: a length hint
                }
                b'}' => self.push(Value::Dict(Rc::default()))?,
                b']' => self.push(Value::List(Rc::default()))?,
                b')' => self.push(Value::Tuple(Rc::from(Vec::new())))?,
                b'N' => self.push(Value::None)?,
                0x88 | 0x89 => self.push(Value::Bool)?,
                b'(' => self.marks.push(self.stack.len()),
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Value::Tuple(items.into()))?;
                }
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Value::List(Rc::new(RefCell::new(items))))?;
                }
                b'd' => {
                    let items = self.pop_mark()?;
                    let pairs = pairs(items).map_err(|p| self.error(at, p))?;
                    self.push(Value::Dict(Rc::new(RefCell::new(pairs))))?;
                }
                0x85..=0x87 => {
                    let n = usize::from(opcode - 0x84);
                    let items = self.pop_n(n)?;
                    self.push(Value::Tuple(items.into()))?;
                }
                b'q' => {
                    let key = u32::from(self.take_u8()?);
                    self.memoize(key)?;
                }
                b'r' => {
                    let key = self.take_u32()?;
                    self.memoize(key)?;
                }
                0x94 => {
                    let key = u32::try_from(self.memo.len()).unwrap_or(u32::MAX);
                    self.memoize(key)?;
                }
                b'h' => {
                    let key = u32::from(self.take_u8()?);
                    self.fetch(key, at)?;
                }
                b'j' => {
                    let key = self.take_u32()?;
                    self.fetch(key, at)?;
                }
                b'X' => {
                    let len = self.take_u32()? as usize;
                    self.push_str(len, at)?;
                }
                0x8c => {
                    let len = usize::from(self.take_u8()?);
                    self.push_str(len, at)?;
                }
                0x8d => {
                    let len = self.take_u64_len()?;
                    self.push_str(len, at)?;
                }
                b'B' => {
                    let len = self.take_u32()? as usize;
                    self.take(len)?;
                    self.push(Value::Bytes)?;
                }
                b'C' => {
                    let len = usize::from(self.take_u8()?);
                    self.take(len)?;
                    self.push(Value::Bytes)?;
                }
                b'J' => {
                    let bytes = self.take(4)?;
                    let value = i32::from_le_bytes(bytes.try_into().expect("4 bytes"));
                    self.push(Value::Int(i64::from(value)))?;
                }
                b'K' => {
                    let value = self.take_u8()?;
                    self.push(Value::Int(i64::from(value)))?;
                }
                b'M' => {
                    let bytes = self.take(2)?;
                    let value = u16::from_le_bytes(bytes.try_into().expect("2 bytes"));
                    self.push(Value::Int(i64::from(value)))?;
                }
                0x8a => {
                    let len = usize::from(self.take_u8()?);
                    let bytes = self.take(len)?;
                    let value = long(bytes)
                        .ok_or_else(|| self.error(at, "an integer wider than 64 bits".into()))?;
                    self.push(Value::Int(value))?;
                }
                b'G' => {
                    self.take(8)?;
                    self.push(Value::Float)?;
                }
                b'c' => {
                    let module = self.take_line(at)?;
                    let name = self.take_line(at)?;
                    self.push(Value::Global(Rc::new((module, name))))?;
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let global = match (&module, &name) {
                        (Value::Str(module), Value::Str(name)) => {
                            Value::Global(Rc::new((module.to_string(), name.to_string())))
                        }
                        _ => return Err(self.error(at, "STACK_GLOBAL of non-strings".into())),
                    };
                    self.push(global)?;
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let storage = storage(&pid).map_err(|p| self.error(at, p))?;
                    self.push(Value::Storage(Rc::new(storage)))?;
                }
                b'R' | 0x81 => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    let value = reduce(&callable, &args, 0).map_err(|p| self.error(at, p))?;
                    self.push(value)?;
                }
                b'b' => {
                    // BUILD sets an object's state (a dict's `_metadata`, a tensor's hooks):
                    // nothing the tensors' values depend on.
                    self.pop()?;
                    self.top(at)?;
                }
                b's' => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    self.dict_insert(vec![(key, value)], at)?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    let pairs = pairs(items).map_err(|p| self.error(at, p))?;
                    self.dict_insert(pairs, at)?;
                }
                b'a' => {
                    let value = self.pop()?;
                    self.list_extend(vec![value], at)?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    self.list_extend(items, at)?;
                }
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let top = self.top(at)?.clone();
                    self.push(top)?;
                }
                _ => {
                    return Err(self.error(
                        at,
                        format!("opcode 0x{opcode:02x} is not one torch.save writes"),
                    ));
                }
            }
        }
    }

    fn error(&self, offset: usize, problem: String) -> PickleError {
        PickleError { offset, problem }
    }

    fn truncated(&self) -> PickleError {
        self.error(self.bytes.len(), "truncated (ends before STOP)".into())
    }

    fn take(&mut self, len: usize) -> Result<&[u8], PickleError> {
        let end = self
            .position
            .checked_add(len)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| self.truncated())?;
        let bytes = &self.bytes[self.position..end];
        self.position = end;
        Ok(bytes)
    }

    fn take_u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }

    fn take_u32(&mut self) -> Result<u32, PickleError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn take_u64_len(&mut self) -> Result<usize, PickleError> {
        let len = u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes"));
        usize::try_from(len).map_err(|_| self.truncated())
    }

    fn take_line(&mut self, at: usize) -> Result<String, PickleError> {
        let rest = &self.bytes[self.position..];
        let len = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| self.truncated())?;
        let line = std::str::from_utf8(&rest[..len])
            .map_err(|_| self.error(at, "a GLOBAL name that is not UTF-8".into()))?
            .to_string();
        self.position += len + 1;
        Ok(line)
    }

    fn push_str(&mut self, len: usize, at: usize) -> Result<(), PickleError> {
        let bytes = self.take(len)?;
        let text = std::str::from_utf8(bytes)
            .map_err(|_| PickleError {
                offset: at,
                problem: "a string that is not UTF-8".into(),
            })?
            .to_string();
        self.push(Value::Str(Rc::from(text)))
    }

    fn push(&mut self, value: Value) -> Result<(), PickleError> {
        if self.stack.len() >= MAX_STACK {
            return Err(self.error(
                self.position,
                "stack deeper than any state dict needs".into(),
            ));
        }
        self.stack.push(value);
        Ok(())
    }

    fn pop(&mut self) -> Result<Value, PickleError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.error(self.position, "pops an empty stack".into()));
        }
        Ok(self.stack.pop().expect("checked above"))
    }

    fn pop_n(&mut self, n: usize) -> Result<Vec<Value>, PickleError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() < floor + n {
            return Err(self.error(self.position, "pops an empty stack".into()));
        }
        Ok(self.stack.split_off(self.stack.len() - n))
    }

    fn pop_mark(&mut self) -> Result<Vec<Value>, PickleError> {
        let mark = self
            .marks
            .pop()
            .ok_or_else(|| self.error(self.position, "no MARK to pop to".into()))?;
        Ok(self.stack.split_off(mark.min(self.stack.len())))
    }

    fn top(&self, at: usize) -> Result<&Value, PickleError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.error(at, "reads an empty stack".into()));
        }
        Ok(self.stack.last().expect("checked above"))
    }

    fn memoize(&mut self, key: u32) -> Result<(), PickleError> {
        let top = self.top(self.position)?.clone();
        self.memo.insert(key, top);
        Ok(())
    }

    fn fetch(&mut self, key: u32, at: usize) -> Result<(), PickleError> {
        let value = self
            .memo
            .get(&key)
            .cloned()
            .ok_or_else(|| self.error(at, format!("memo {key} was never stored")))?;
        self.push(value)
    }

    fn dict_insert(&mut self, items: Vec<(Value, Value)>, at: usize) -> Result<(), PickleError> {
        match self.top(at)? {
            Value::Dict(dict) => {
                dict.borrow_mut().extend(items);
                Ok(())
            }
            _ => Err(self.error(at, "SETITEM on something that is not a dict".into())),
        }
    }

    fn list_extend(&mut self, items: Vec<Value>, at: usize) -> Result<(), PickleError> {
        match self.top(at)? {
            Value::List(list) => {
                list.borrow_mut().extend(items);
                Ok(())
            }
            _ => Err(self.error(at, "APPEND on something that is not a list".into())),
        }
    }
}

/// `[k0, v0, k1, v1, …]` as pairs.
fn pairs(items: Vec<Value>) -> Result<Vec<(Value, Value)>, String> {
    if !items.len().is_multiple_of(2) {
        return Err("a dict with an odd number of keys and values".into());
    }
    let mut items = items.into_iter();
    let mut pairs = Vec::with_capacity(items.len() / 2);
    while let (Some(key), Some(value)) = (items.next(), items.next()) {
        pairs.push((key, value));
    }
    Ok(pairs)
}

/// A little-endian two's-complement integer of up to 8 bytes (`LONG1`).
fn long(bytes: &[u8]) -> Option<i64> {
    if bytes.len() > 8 {
        return None;
    }
    if bytes.is_empty() {
        return Some(0);
    }
    let negative = bytes[bytes.len() - 1] & 0x80 != 0;
    let mut padded = [if negative { 0xff } else { 0 }; 8];
    padded[..bytes.len()].copy_from_slice(bytes);
    Some(i64::from_le_bytes(padded))
}

/// A persistent id: `('storage', <class torch.XStorage>, key, location, numel)`.
fn storage(pid: &Value) -> Result<StorageRef, String> {
    let bad = || {
        format!(
            "a persistent id ({}) that is not a storage reference",
            pid.kind()
        )
    };
    let Value::Tuple(items) = pid else {
        return Err(bad());
    };
    match &items[..] {
        [
            Value::Str(tag),
            Value::Global(class),
            Value::Str(key),
            _,
            Value::Int(numel),
            ..,
        ] if &**tag == "storage" => Ok(StorageRef {
            key: key.to_string(),
            type_name: class.1.clone(),
            numel: *numel,
        }),
        _ => Err(bad()),
    }
}

/// The value of `callable(*args)` for the callables a state dict uses.
fn reduce(callable: &Value, args: &Value, depth: usize) -> Result<Value, String> {
    let Value::Global(global) = callable else {
        return Err(format!("calls a {}, not a class", callable.kind()));
    };
    let (module, name) = (global.0.as_str(), global.1.as_str());
    let args: &[Value] = match args {
        Value::Tuple(items) => items,
        _ => return Err(format!("{module}.{name} called without an argument tuple")),
    };
    match (module, name) {
        ("torch._utils", "_rebuild_tensor_v2" | "_rebuild_tensor") => tensor(args),
        ("torch._utils", "_rebuild_parameter" | "_rebuild_parameter_with_state") => {
            match args.first() {
                Some(tensor @ Value::Tensor(_)) => Ok(tensor.clone()),
                _ => Err(format!("{module}.{name} of something that is not a tensor")),
            }
        }
        ("torch._tensor", "_rebuild_from_type_v2") if depth < 4 => match args {
            [function, _, Value::Tuple(_), ..] => reduce(function, &args[2], depth + 1),
            _ => Err(format!("{module}.{name} with unexpected arguments")),
        },
        ("collections", "OrderedDict") => Ok(Value::Dict(Rc::default())),
        _ => Err(format!(
            "`{module}.{name}` is not part of a state dict of tensors (refused; nothing was run)"
        )),
    }
}

/// `_rebuild_tensor_v2(storage, storage_offset, size, stride, …)`.
fn tensor(args: &[Value]) -> Result<Value, String> {
    let ints = |value: &Value, what: &str| -> Result<Vec<i64>, String> {
        match value {
            Value::Tuple(items) => items
                .iter()
                .map(|item| match item {
                    Value::Int(v) => Ok(*v),
                    _ => Err(format!("a tensor {what} holds a non-integer")),
                })
                .collect(),
            _ => Err(format!("a tensor {what} that is not a tuple")),
        }
    };
    match args {
        [
            Value::Storage(storage),
            Value::Int(offset),
            size,
            stride,
            ..,
        ] => Ok(Value::Tensor(Rc::new(TensorRef {
            storage: storage.clone(),
            offset: *offset,
            shape: ints(size, "size")?,
            stride: ints(stride, "stride")?,
        }))),
        _ => Err("_rebuild_tensor without (storage, offset, size, stride)".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long1_sign_extends() {
        assert_eq!(long(&[0xff]), Some(-1));
        assert_eq!(long(&[0x00, 0x01]), Some(256));
        assert_eq!(long(&[]), Some(0));
        assert_eq!(long(&[0; 9]), None);
    }

    #[test]
    fn an_arbitrary_callable_is_refused_by_name() {
        // cos\nsystem\n(S'true'\ntR. — the classic payload, in protocol 2 opcodes.
        let mut pickle = b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R.".to_vec();
        let error = load(&pickle).err().unwrap();
        assert!(error.problem.contains("`os.system`"), "{error}");
        pickle.truncate(10);
        assert!(load(&pickle).err().unwrap().problem.contains("truncated"));
    }

    #[test]
    fn memo_fetches_share_instead_of_copying() {
        // A list appended to itself through the memo 40 times would be 2^40 values if copied.
        let mut pickle = b"\x80\x02]q\x00".to_vec();
        for _ in 0..40 {
            pickle.extend_from_slice(b"h\x00a");
        }
        pickle.push(b'.');
        let value = load(&pickle).ok().unwrap();
        let Value::List(list) = &value else {
            panic!("a list")
        };
        assert_eq!(list.borrow().len(), 40);
        list.borrow_mut().clear(); // break the cycle
    }

    #[test]
    fn a_million_nested_tuples_drop_without_recursion() {
        let mut pickle = b"\x80\x02)".to_vec();
        pickle.extend(std::iter::repeat_n(0x85, 1_000_000));
        pickle.push(b'.');
        assert_eq!(load(&pickle).ok().unwrap().kind(), "tuple");
    }
}
