//! `#[derive(Module)]` for Lazuli's `nn::Module` trait (re-exported as
//! `lazuli::nn::Module`, beside the trait): the module's own parameters,
//! buffers, weight-decay exemptions and children come from its fields, and
//! `Module::forward` calls the type's inherent `forward` method.
//!
//! Fields, by their type as written:
//! - `Tensor` (or `Option<Tensor>`, listed when `Some`): a parameter named
//!   after the field (`Vec<Tensor>`: parameters `field.0`, `field.1`, ...,
//!   PyTorch's `ParameterList`); `#[module(buffer)]` makes it a buffer instead
//!   (running statistics), `#[module(no_weight_decay)]` exempts a
//!   parameter from weight decay (by default, as `Module`'s default, those
//!   of rank 0 or 1 are);
//! - numbers, `bool`, `String`, `char` and `PhantomData`: not part of the
//!   module;
//! - `Vec<M>`: children named `field.0`, `field.1`, ... (PyTorch's
//!   `ModuleList`); `Option<M>`: a child when `Some`;
//! - anything else: a child module named after the field (it must
//!   implement `Module`);
//! - `#[module(skip)]` leaves any field out (a cache, a config struct).
//!
//! The same fields, mutably, give `own_tensors_mut` and `children_mut`
//! (what `ModuleExt::to_device` walks).
//!
//! Tuple structs name their fields `0`, `1`, ... as PyTorch's
//! `Sequential` does. Train/eval reaches children through
//! `ModuleExt::set_training`, so a derived module needs no mode of its
//! own. A missing inherent `forward` is a compile error (the generated
//! `Module::forward` would otherwise call itself).
//!
//! This crate only generates code; everything it names lives in `lazuli`.

use proc_macro::TokenStream;
use proc_macro2::TokenStream as Tokens;
use quote::{format_ident, quote};
use syn::{parse_macro_input, Data, DeriveInput, Fields, GenericArgument, PathArguments, Type};

/// Derives `lazuli::nn::Module` from a struct's fields (see the crate doc).
#[proc_macro_derive(Module, attributes(module))]
pub fn derive_module(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    match expand(&input) {
        Ok(t) => t.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

/// What a field is to the module.
enum Role {
    Parameter { optional: bool, no_decay: bool },
    Buffer { optional: bool },
    ParameterList { no_decay: bool },
    BufferList,
    Child,
    OptionalChild,
    Children,
    Ignored,
}

/// The `#[module(...)]` flags of a field.
#[derive(Default)]
struct Flags {
    buffer: bool,
    skip: bool,
    no_weight_decay: bool,
}

fn flags(field: &syn::Field) -> syn::Result<Flags> {
    let mut f = Flags::default();
    for attr in field.attrs.iter().filter(|a| a.path().is_ident("module")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("buffer") {
                f.buffer = true;
            } else if meta.path.is_ident("skip") {
                f.skip = true;
            } else if meta.path.is_ident("no_weight_decay") {
                f.no_weight_decay = true;
            } else {
                return Err(meta.error("expected `buffer`, `skip` or `no_weight_decay`"));
            }
            Ok(())
        })?;
    }
    if f.skip && (f.buffer || f.no_weight_decay) {
        return Err(syn::Error::new_spanned(field, "`skip` cannot be combined with other `module` flags"));
    }
    if f.buffer && f.no_weight_decay {
        return Err(syn::Error::new_spanned(field, "a buffer is not a parameter: `no_weight_decay` does not apply"));
    }
    Ok(f)
}

/// The last path segment of `ty` and its single generic argument, if any.
fn last_segment(ty: &Type) -> Option<(String, Option<&Type>)> {
    let Type::Path(p) = ty else { return None };
    let seg = p.path.segments.last()?;
    let arg = match &seg.arguments {
        PathArguments::AngleBracketed(a) if a.args.len() == 1 => match a.args.first() {
            Some(GenericArgument::Type(t)) => Some(t),
            _ => None,
        },
        _ => None,
    };
    Some((seg.ident.to_string(), arg))
}

fn is_tensor(ty: &Type) -> bool {
    matches!(last_segment(ty), Some((name, None)) if name == "Tensor")
}

fn is_plain_data(ty: &Type) -> bool {
    const PLAIN: &[&str] = &[
        "f32",
        "f64",
        "i8",
        "i16",
        "i32",
        "i64",
        "i128",
        "isize",
        "u8",
        "u16",
        "u32",
        "u64",
        "u128",
        "usize",
        "bool",
        "char",
        "String",
        "PhantomData",
        "DType",
        "Device",
    ];
    match ty {
        Type::Tuple(t) => t.elems.is_empty(),
        Type::Reference(_) | Type::Array(_) | Type::BareFn(_) => true,
        _ => matches!(last_segment(ty), Some((name, _)) if PLAIN.contains(&name.as_str())),
    }
}

fn role(field: &syn::Field, f: &Flags) -> syn::Result<Role> {
    if f.skip {
        return Ok(Role::Ignored);
    }
    let ty = &field.ty;
    let (optional, inner) = match last_segment(ty) {
        Some((name, Some(inner))) if name == "Option" => (true, inner),
        _ => (false, ty),
    };
    if let Some((name, Some(item))) = last_segment(ty) {
        if name == "Vec" && is_tensor(item) {
            return Ok(if f.buffer { Role::BufferList } else { Role::ParameterList { no_decay: f.no_weight_decay } });
        }
    }
    if is_tensor(inner) {
        return Ok(if f.buffer {
            Role::Buffer { optional }
        } else {
            Role::Parameter { optional, no_decay: f.no_weight_decay }
        });
    }
    if f.buffer || f.no_weight_decay {
        return Err(syn::Error::new_spanned(ty, "`buffer` and `no_weight_decay` apply to `Tensor` fields only"));
    }
    if is_plain_data(ty) {
        return Ok(Role::Ignored);
    }
    Ok(match last_segment(ty) {
        Some((name, Some(_))) if name == "Option" => Role::OptionalChild,
        Some((name, Some(_))) if name == "Vec" => Role::Children,
        _ => Role::Child,
    })
}

fn expand(input: &DeriveInput) -> syn::Result<Tokens> {
    let Data::Struct(data) = &input.data else {
        return Err(syn::Error::new_spanned(&input.ident, "#[derive(Module)] supports structs only"));
    };
    let fields: Vec<(Tokens, String, &syn::Field)> = match &data.fields {
        Fields::Named(n) => n
            .named
            .iter()
            .map(|f| {
                let id = f.ident.clone().expect("named fields have names");
                let name = id.to_string();
                let name = name.strip_prefix("r#").unwrap_or(&name).to_string();
                (quote!(#id), name, f)
            })
            .collect(),
        Fields::Unnamed(u) => u
            .unnamed
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let idx = syn::Index::from(i);
                (quote!(#idx), i.to_string(), f)
            })
            .collect(),
        Fields::Unit => Vec::new(),
    };
    let (mut params, mut buffers, mut children, mut no_decay) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // The same fields, mutably (`to_device`): tensors, then sub-modules.
    let (mut tensors_mut, mut children_mut) = (Vec::new(), Vec::new());
    for (access, name, field) in &fields {
        let f = flags(field)?;
        match role(field, &f)? {
            Role::Parameter { optional, no_decay: nd } => {
                params.push(push_tensor(access, name, optional));
                tensors_mut.push(push_tensor_mut(access, optional));
                if nd {
                    no_decay.push(quote!(v.push(#name.to_string());));
                }
            }
            Role::Buffer { optional } => {
                buffers.push(push_tensor(access, name, optional));
                tensors_mut.push(push_tensor_mut(access, optional));
            }
            Role::ParameterList { no_decay: nd } => {
                params.push(push_list(access, name));
                tensors_mut.push(quote!(v.extend(self.#access.iter_mut());));
                if nd {
                    no_decay.push(quote! {
                        for i in 0..self.#access.len() {
                            v.push(format!("{}.{}", #name, i));
                        }
                    });
                }
            }
            Role::BufferList => {
                buffers.push(push_list(access, name));
                tensors_mut.push(quote!(v.extend(self.#access.iter_mut());));
            }
            Role::Child => {
                children.push(quote!(v.push((#name.to_string(), &self.#access as &dyn ::lazuli::nn::Module));));
                children_mut.push(quote!(v.push(&mut self.#access as &mut dyn ::lazuli::nn::Module);));
            }
            Role::OptionalChild => {
                children.push(quote! {
                    if let Some(m) = &self.#access {
                        v.push((#name.to_string(), m as &dyn ::lazuli::nn::Module));
                    }
                });
                children_mut.push(quote! {
                    if let Some(m) = &mut self.#access {
                        v.push(m as &mut dyn ::lazuli::nn::Module);
                    }
                });
            }
            Role::Children => {
                children.push(quote! {
                    for (i, m) in self.#access.iter().enumerate() {
                        v.push((format!("{}.{}", #name, i), m as &dyn ::lazuli::nn::Module));
                    }
                });
                children_mut.push(quote! {
                    for m in self.#access.iter_mut() {
                        v.push(m as &mut dyn ::lazuli::nn::Module);
                    }
                });
            }
            Role::Ignored => {}
        }
    }
    let ident = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let x = format_ident!("x");
    let no_decay_fn = if no_decay.is_empty() {
        quote!()
    } else {
        quote! {
            fn own_no_weight_decay(&self) -> ::std::vec::Vec<::std::string::String> {
                let mut v: ::std::vec::Vec<::std::string::String> = self
                    .own_parameters()
                    .into_iter()
                    .filter(|(_, t)| t.rank() <= 1)
                    .map(|(n, _)| n)
                    .collect();
                #(#no_decay)*
                v.sort();
                v.dedup();
                v
            }
        }
    };
    Ok(quote! {
        const _: () = {
        // `Self::forward` below must be the type's inherent method, which
        // takes priority over trait methods. Without one it would be
        // `Module::forward` itself (endless recursion); this trait, in
        // scope only here, makes that case a compile error instead (a
        // mismatched argument, or two applicable `forward`s).
        #[doc(hidden)]
        trait DeriveModuleNeedsAnInherentForward {
            fn forward(&self, define_an_inherent_forward_method: ());
        }

        impl #impl_generics DeriveModuleNeedsAnInherentForward for #ident #ty_generics #where_clause {
            fn forward(&self, _: ()) {}
        }

        impl #impl_generics ::lazuli::nn::Module for #ident #ty_generics #where_clause {
            fn forward(&self, #x: &::lazuli::Tensor) -> ::lazuli::Result<::lazuli::Tensor> {
                Self::forward(self, #x)
            }

            fn own_parameters(&self) -> ::std::vec::Vec<(::std::string::String, ::lazuli::Tensor)> {
                #[allow(unused_mut)]
                let mut v = ::std::vec::Vec::new();
                #(#params)*
                v
            }

            fn own_buffers(&self) -> ::std::vec::Vec<(::std::string::String, ::lazuli::Tensor)> {
                #[allow(unused_mut)]
                let mut v = ::std::vec::Vec::new();
                #(#buffers)*
                v
            }

            fn children(&self) -> ::std::vec::Vec<(::std::string::String, &dyn ::lazuli::nn::Module)> {
                #[allow(unused_mut)]
                let mut v: ::std::vec::Vec<(::std::string::String, &dyn ::lazuli::nn::Module)> = ::std::vec::Vec::new();
                #(#children)*
                v
            }

            fn own_tensors_mut(&mut self) -> ::std::vec::Vec<&mut ::lazuli::Tensor> {
                #[allow(unused_mut)]
                let mut v: ::std::vec::Vec<&mut ::lazuli::Tensor> = ::std::vec::Vec::new();
                #(#tensors_mut)*
                v
            }

            fn children_mut(&mut self) -> ::std::vec::Vec<&mut dyn ::lazuli::nn::Module> {
                #[allow(unused_mut)]
                let mut v: ::std::vec::Vec<&mut dyn ::lazuli::nn::Module> = ::std::vec::Vec::new();
                #(#children_mut)*
                v
            }

            #no_decay_fn
        }
        };
    })
}

/// Pushes `(name, tensor)` for a tensor field (an optional one when `Some`).
fn push_tensor(access: &Tokens, name: &str, optional: bool) -> Tokens {
    if optional {
        quote! {
            if let Some(t) = &self.#access {
                v.push((#name.to_string(), t.clone()));
            }
        }
    } else {
        quote!(v.push((#name.to_string(), self.#access.clone()));)
    }
}

/// Pushes a tensor field, mutably (an optional one when `Some`).
fn push_tensor_mut(access: &Tokens, optional: bool) -> Tokens {
    if optional {
        quote!(v.extend(self.#access.as_mut());)
    } else {
        quote!(v.push(&mut self.#access);)
    }
}

/// Pushes `(name.i, tensor)` for each tensor of a `Vec<Tensor>` field.
fn push_list(access: &Tokens, name: &str) -> Tokens {
    quote! {
        for (i, t) in self.#access.iter().enumerate() {
            v.push((format!("{}.{}", #name, i), t.clone()));
        }
    }
}
